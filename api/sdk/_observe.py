"""``client.runs`` methods about where the time goes: the measured breakdown, profiles on demand and run
artifacts (Chrome traces, stack dumps); exporting the weights. Mixed into ``api.sdk.resources.Runs``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from api.spec import ArtifactList, ArtifactPublic, ExportPublic, ProfileAccepted, RunBreakdown

from ._base import tolerant_validate

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client


class RunDiagnostics:
    _client: Client

    def breakdown(self, run_id: str) -> RunBreakdown:
        """Per term (compute, tp/pp/dp communication, bubble, optimizer, data wait, other): predicted vs measured
        (median over steady-state steps) and per rank."""
        return tolerant_validate(RunBreakdown, self._client.request("GET", f"/v1/runs/{run_id}/breakdown"))

    def profile(self, run_id: str, *, steps: int = 3) -> ProfileAccepted:
        """Ask a running run to profile its next ``steps`` steps on every rank (torch.profiler); the Chrome traces
        appear as artifacts (``artifacts(run_id)``) once the steps ran."""
        data = self._client.request("POST", f"/v1/runs/{run_id}/profile", json={"steps": steps})
        return tolerant_validate(ProfileAccepted, data)

    def artifacts(self, run_id: str) -> list[ArtifactPublic]:
        """The run's stored files (profiles, pipeline timelines, stack dumps), newest attempt first."""
        return tolerant_validate(ArtifactList, self._client.request("GET", f"/v1/runs/{run_id}/artifacts")).items

    def artifact(self, run_id: str, name: str, *, attempt: int | None = None) -> Any:
        """One artifact's content: a Chrome trace as its decoded JSON (a dict with ``traceEvents``), text as str."""
        path = f"/v1/runs/{run_id}/artifacts/{quote(name)}"
        return self._client.request("GET", path, params={"attempt": attempt})

    def download_artifact(self, run_id: str, name: str, dest: str | Path, *, attempt: int | None = None) -> Path:
        """Write one artifact to ``dest`` (a file, or a directory to put it in under its base name): its bytes as
        stored, so the file has the size the artifact list shows."""
        path = f"/v1/runs/{run_id}/artifacts/{quote(name)}"
        data = self._client.request("GET", path, params={"attempt": attempt}, raw=True)
        out = Path(dest)
        if out.is_dir():
            out = out / Path(name).name
        out.write_bytes(data)
        return out

    def export(self, run_id: str, *, out: str, format: str = "hf", checkpoint: int | None = None) -> ExportPublic:
        """Write the run's checkpoint (``checkpoint``: its step; the latest by default), whatever layout saved it,
        as a Hugging Face model (config.json + model.safetensors) into ``out`` on the service's filesystem."""
        body = {"format": format, "out": out, "checkpoint": checkpoint}
        return tolerant_validate(ExportPublic, self._client.request("POST", f"/v1/runs/{run_id}/export", json=body))
