"""Exporting a run's weights: ``POST /v1/runs/{id}/export`` (``meshrun export``, ``client.runs.export``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from api.spec._base import MAX_STEPS, _Public, _Spec


class ExportRequest(_Spec):
    """Which checkpoint, in which format, to which directory (on the service's filesystem, which the run's
    checkpoints share; under the service's allowed roots when auth is on)."""

    format: Literal["hf"] = Field("hf", description="hf: Hugging Face config.json + model.safetensors.")
    out: str = Field(
        ..., min_length=1, max_length=4096, description="Directory to write (created; may not hold other files)."
    )
    checkpoint: int | None = Field(None, ge=0, le=MAX_STEPS, description="Step of the checkpoint; null: the latest.")

    @field_validator("out")
    @classmethod
    def _path_shape(cls, v: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in v) or "://" in v:
            raise ValueError("out must be a local directory path without control characters")
        return v


class ExportPublic(_Public):
    """What an export wrote."""

    run_id: str
    format: str
    step: int
    out: str
    files: list[str] = Field(default_factory=list)
    n_params: int = 0
