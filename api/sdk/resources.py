"""Resources of the client (``client.runs``, ``client.plans``, ``client.sweeps``, ``client.cluster``) and the
objects they return: the api.schemas response models, with a few convenience methods bound to the client."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal

from pydantic import PrivateAttr

from api.schemas import (
    CheckpointPublic, ClusterPublic, EventList, EventPublic, Layout, LogsPublic, MetricList, MetricRow,
    PlanResponse, RunList, RunPublic, RunSpec, RunStatus, SweepList, SweepPublic,
)

from ._base import tolerant_validate
from ._errors import ConflictError, RunFailedError, WaitTimeoutError
from ._specs import SpecInput, apply_overrides, parse_layout, to_body

if TYPE_CHECKING:  # pragma: no cover
    import pandas

    from .client import Client

log = logging.getLogger("meshrun.client")

SWEEP_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
_RESUMABLE_STATES = frozenset({RunStatus.FAILED.value, RunStatus.CANCELLED.value})
_RESUMED_STATES = frozenset({RunStatus.QUEUED.value, RunStatus.STARTING.value, RunStatus.RUNNING.value})


# ----------------------------------------------------------------------------------------------- objects
class Run(RunPublic):
    """A run as the API returns it (``RunPublic``) plus methods that call back into the client."""

    _client: Any = PrivateAttr(default=None)

    def _bind(self, client: "Client") -> "Run":
        self._client = client
        return self

    def _replace(self, other: "Run") -> "Run":
        for name in type(self).model_fields:
            object.__setattr__(self, name, getattr(other, name))
        return self

    @property
    def done(self) -> bool:
        return RunStatus(self.status).terminal

    def refresh(self) -> "Run":
        """Re-read the run from the service (in place) and return it."""
        return self._replace(self._client.runs.get(self.id))

    def wait(self, *, progress: bool | Any = False, timeout: float | None = None, poll_interval_s: float = 1.0,
             raise_on_failure: bool = False) -> "Run":
        """Block until the run finishes; see ``client.runs.wait``. Updates this object and returns it."""
        final = self._client.runs.wait(self.id, progress=progress, timeout=timeout, poll_interval_s=poll_interval_s,
                                       raise_on_failure=raise_on_failure)
        return self._replace(final)

    def metrics(self, *, since_step: int = 0, attempt: int | None = None) -> list[MetricRow]:
        return self._client.runs.metrics(self.id, since_step=since_step, attempt=attempt)

    def metrics_df(self, *, since_step: int = 0, attempt: int | None = None) -> "pandas.DataFrame":
        return self._client.runs.metrics_df(self.id, since_step=since_step, attempt=attempt)

    def events(self) -> list[EventPublic]:
        return self._client.runs.events(self.id)

    def logs(self) -> str:
        return self._client.runs.logs(self.id)

    def checkpoints(self) -> list[CheckpointPublic]:
        return self._client.runs.checkpoints(self.id)

    def cancel(self) -> "Run":
        return self._replace(self._client.runs.cancel(self.id))

    def resume(self, *, layout: Layout | dict[str, Any] | str | None = None, batch: Any = None,
               steps: int | None = None) -> "Run":
        return self._replace(self._client.runs.resume(self.id, layout=layout, batch=batch, steps=steps))


class RunPage(RunList):
    """One page of ``client.runs.list``: ``items`` (Run objects), ``total``, ``limit``, ``offset``."""

    items: list[Run]  # type: ignore[assignment]


class Sweep(SweepPublic):
    """A sweep as the API returns it (``SweepPublic``) plus client-bound methods."""

    _client: Any = PrivateAttr(default=None)

    def _bind(self, client: "Client") -> "Sweep":
        self._client = client
        return self

    def _replace(self, other: "Sweep") -> "Sweep":
        for name in type(self).model_fields:
            object.__setattr__(self, name, getattr(other, name))
        return self

    @property
    def done(self) -> bool:
        return str(self.status).upper() in SWEEP_TERMINAL

    def refresh(self) -> "Sweep":
        return self._replace(self._client.sweeps.get(self.id))

    def wait(self, *, progress: bool | Any = False, timeout: float | None = None,
             poll_interval_s: float = 2.0) -> "Sweep":
        return self._replace(self._client.sweeps.wait(self.id, progress=progress, timeout=timeout,
                                                      poll_interval_s=poll_interval_s))

    def cancel(self) -> "Sweep":
        return self._replace(self._client.sweeps.cancel(self.id))

    def best_run_spec(self) -> RunSpec:
        """The sweep's base spec with the best trial's layout and micro-batch size (ValueError if none)."""
        if self.best_trial is None:
            raise ValueError(f"sweep {self.id} ({self.status}) has no best trial yet; wait for it to finish")
        spec = self.spec.base.model_copy(deep=True)
        spec.layout = self.best_trial.layout.model_copy()
        spec.batch.micro_batch_size = self.best_trial.micro_batch_size
        return spec


class SweepPage(SweepList):
    items: list[Sweep]  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------- helpers
def _items(data: Any) -> list[Any]:
    if isinstance(data, dict) and "items" in data:
        return list(data["items"])
    if isinstance(data, list):
        return data
    raise TypeError(f"unexpected response shape: {type(data).__name__}")


def _status_values(status: Any) -> list[str] | None:
    if status is None:
        return None
    if isinstance(status, (str, RunStatus)):
        status = [status]
    return [getattr(s, "value", s).upper() for s in status]


class _Resource:
    def __init__(self, client: "Client") -> None:
        self._client = client


# ------------------------------------------------------------------------------------------------- runs
class Runs(_Resource):
    def create(self, spec: SpecInput, *, overrides: Iterable[str] = (), idempotency_key: str | None = None,
               timeout: float | None = None) -> Run:
        """Submit a run. ``spec``: a ``RunSpec``, a dict, or a path to a YAML/JSON file; ``overrides``:
        ``["layout.tp=2", "train.steps=20"]``. The POST carries an idempotency key (generated unless given),
        so retries never create a second run; passing your own key makes re-submission safe across
        processes too."""
        body = apply_overrides(to_body(spec), overrides)
        data = self._client.request("POST", "/v1/runs", json=body, idempotency_key=idempotency_key, timeout=timeout)
        return tolerant_validate(Run, data)._bind(self._client)

    def get(self, run_id: str) -> Run:
        return tolerant_validate(Run, self._client.request("GET", f"/v1/runs/{run_id}"))._bind(self._client)

    def list(self, *, status: str | RunStatus | Iterable[str | RunStatus] | None = None, name: str | None = None,
             sweep_id: str | None = None, limit: int = 50, offset: int = 0) -> RunPage:
        params = {"status": _status_values(status), "name": name, "sweep_id": sweep_id, "limit": limit,
                  "offset": offset}
        page = tolerant_validate(RunPage, self._client.request("GET", "/v1/runs", params=params))
        for r in page.items:
            r._bind(self._client)
        return page

    def iter(self, *, status: Any = None, name: str | None = None, sweep_id: str | None = None,
             page_size: int = 100) -> Iterator[Run]:
        """Every matching run, newest first, fetching pages as needed."""
        offset = 0
        while True:
            page = self.list(status=status, name=name, sweep_id=sweep_id, limit=page_size, offset=offset)
            yield from page.items
            offset += len(page.items)
            if not page.items or offset >= page.total:
                return

    def metrics(self, run_id: str, *, since_step: int = 0, attempt: int | None = None) -> list[MetricRow]:
        """Per-step metric rows (step > since_step), each step once (the latest attempt's)."""
        params = {"since_step": since_step or None, "attempt": attempt}
        data = self._client.request("GET", f"/v1/runs/{run_id}/metrics", params=params)
        if isinstance(data, list):
            return [tolerant_validate(MetricRow, r) for r in data]
        return tolerant_validate(MetricList, data).items

    def metrics_df(self, run_id: str, *, since_step: int = 0, attempt: int | None = None) -> "pandas.DataFrame":
        """The metrics as a pandas DataFrame indexed by step (needs pandas: pip install pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("metrics_df() needs pandas: pip install pandas (or use metrics() for rows)") from e
        rows = [r.model_dump() for r in self.metrics(run_id, since_step=since_step, attempt=attempt)]
        columns = list(MetricRow.model_fields)
        return pd.DataFrame(rows, columns=columns).set_index("step")

    def events(self, run_id: str) -> list[EventPublic]:
        data = self._client.request("GET", f"/v1/runs/{run_id}/events")
        if isinstance(data, list):
            return [tolerant_validate(EventPublic, e) for e in data]
        return tolerant_validate(EventList, data).items

    def logs(self, run_id: str) -> str:
        data = self._client.request("GET", f"/v1/runs/{run_id}/logs")
        if isinstance(data, str):
            return data
        return tolerant_validate(LogsPublic, data).logs

    def checkpoints(self, run_id: str) -> list[CheckpointPublic]:
        data = self._client.request("GET", f"/v1/runs/{run_id}/checkpoints")
        return [tolerant_validate(CheckpointPublic, c) for c in _items(data)]

    def cancel(self, run_id: str) -> Run:
        """Cancel a run. Safe to retry: when a retried cancel gets 409 because its first attempt (whose answer
        was lost) already cancelled the run, the CANCELLED run is returned."""
        retried: list[int] = []
        try:
            data = self._client.request("POST", f"/v1/runs/{run_id}/cancel", on_retry=lambda: retried.append(1))
        except ConflictError:
            if retried:
                run = self.get(run_id)
                if RunStatus(run.status) == RunStatus.CANCELLED:
                    log.info("cancel of %s was retried and the run is CANCELLED: an earlier attempt did it", run_id)
                    return run
            raise
        return tolerant_validate(Run, data)._bind(self._client)

    def resume(self, run_id: str, *, layout: Layout | dict[str, Any] | str | None = None, batch: Any = None,
               steps: int | None = None, idempotency_key: str | None = None) -> Run:
        """Resume a stopped run from its latest checkpoint, optionally on a new ``layout`` (``"dp=2,tp=1"``,
        a dict or a Layout; the checkpoint is resharded), ``batch`` or total ``steps``."""
        body: dict[str, Any] = {}
        if layout is not None:
            body["layout"] = parse_layout(layout) if isinstance(layout, str) else to_body(layout)
        if batch is not None:
            body["batch"] = to_body(batch)
        if steps is not None:
            body["steps"] = steps
        # The service does not honour Idempotency-Key on resume: with retries on, remember the run's state first,
        # so a retry that gets 409 (its first attempt, whose answer was lost, already resumed the run) can tell.
        before = self.get(run_id) if self._client.max_retries > 0 else None
        retried: list[int] = []
        try:
            data = self._client.request("POST", f"/v1/runs/{run_id}/resume", json=body,
                                        idempotency_key=idempotency_key, on_retry=lambda: retried.append(1))
        except ConflictError:
            if retried and before is not None:
                run = self.get(run_id)
                if RunStatus(run.status).value in _RESUMED_STATES and (
                        RunStatus(before.status).value in _RESUMABLE_STATES
                                                      or (run.attempts or 0) > (before.attempts or 0)):
                    log.info("resume of %s was retried and the run is %s again: an earlier attempt did it",
                             run_id, RunStatus(run.status).value)
                    return run
            raise
        return tolerant_validate(Run, data)._bind(self._client)

    def wait(self, run_id: str, *, progress: bool | Any = False, timeout: float | None = None,
             poll_interval_s: float = 1.0, raise_on_failure: bool = False) -> Run:
        """Poll until the run is SUCCEEDED, FAILED or CANCELLED and return it.

        ``progress=True`` (or a rich Console) shows a live bar: step/total, loss, tokens/s, ETA (metrics are
        fetched incrementally with ``since_step``). ``timeout`` (seconds) raises WaitTimeoutError;
        ``raise_on_failure`` raises RunFailedError for a FAILED/CANCELLED run."""
        from ._progress import RunProgress

        deadline = None if timeout is None else time.monotonic() + timeout
        view = RunProgress.create(progress)
        last_step = 0
        try:
            while True:
                run = self.get(run_id)
                if view is not None:
                    rows = self.metrics(run_id, since_step=last_step) if run.status != RunStatus.QUEUED else []
                    if rows:
                        last_step = max(last_step, rows[-1].step)
                    view.update(run, rows)
                if RunStatus(run.status).terminal:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeoutError(f"run {run_id} still {run.status.value} after {timeout}s", run_id=run_id,
                                           last=run)
                wait_s = poll_interval_s if deadline is None else max(0.0, min(poll_interval_s,
                                                                              deadline - time.monotonic()))
                time.sleep(wait_s)
        finally:
            if view is not None:
                view.close()
        if raise_on_failure and run.status != RunStatus.SUCCEEDED:
            raise RunFailedError(run)
        return run


# ------------------------------------------------------------------------------------------------ plans
class Plans(_Resource):
    def create(self, request: SpecInput | None = None, *, model: Any = None, cluster: Any = None,
               global_batch_size: int | None = None, seq_len: int | None = None,
               precision: Literal["fp32", "bf16", "fp16"] | None = None, top_k: int | None = None,
               layout: Layout | dict[str, Any] | str | None = None, micro_batch_size: int | None = None,
               activation_checkpointing: str | None = None) -> PlanResponse:
        """Ask the planner for the best layouts (or to score one ``layout``). Give a ``PlanRequest`` (model,
        dict, file) or the fields as keywords, e.g. ``model={"name": "gpt", "preset": "7b"},
        cluster={"device": "H100", "gpus_per_node": 8, "nodes": 4}, global_batch_size=512``; keywords
        override the request's fields."""
        body: dict[str, Any] = to_body(request) if request is not None else {}
        if isinstance(layout, str):
            layout = parse_layout(layout)
        for key, value in (("model", model), ("cluster", cluster), ("global_batch_size", global_batch_size),
                           ("seq_len", seq_len), ("precision", precision), ("top_k", top_k), ("layout", layout),
                           ("micro_batch_size", micro_batch_size),
                           ("activation_checkpointing", activation_checkpointing)):
            if value is not None:
                body[key] = to_body(value) if hasattr(value, "model_dump") else value
        data = self._client.request("POST", "/v1/plans", json=body)
        return tolerant_validate(PlanResponse, data)


# ----------------------------------------------------------------------------------------------- sweeps
class Sweeps(_Resource):
    def create(self, spec: SpecInput, *, overrides: Iterable[str] = (), idempotency_key: str | None = None) -> Sweep:
        """Start a layout sweep (``SweepCreate``, dict or YAML path: base run spec, search space, budget)."""
        body = apply_overrides(to_body(spec), overrides)
        data = self._client.request("POST", "/v1/sweeps", json=body, idempotency_key=idempotency_key)
        return tolerant_validate(Sweep, data)._bind(self._client)

    def get(self, sweep_id: str) -> Sweep:
        return tolerant_validate(Sweep, self._client.request("GET", f"/v1/sweeps/{sweep_id}"))._bind(self._client)

    def list(self, *, status: str | None = None, limit: int = 50, offset: int = 0) -> SweepPage:
        params = {"status": status, "limit": limit, "offset": offset}
        page = tolerant_validate(SweepPage, self._client.request("GET", "/v1/sweeps", params=params))
        for s in page.items:
            s._bind(self._client)
        return page

    def cancel(self, sweep_id: str) -> Sweep:
        data = self._client.request("POST", f"/v1/sweeps/{sweep_id}/cancel")
        return tolerant_validate(Sweep, data)._bind(self._client)

    def wait(self, sweep_id: str, *, progress: bool | Any = False, timeout: float | None = None,
             poll_interval_s: float = 2.0) -> Sweep:
        """Poll until the sweep finishes; ``progress=True`` shows trials done / max trials and the best so far."""
        from ._progress import SweepProgress

        deadline = None if timeout is None else time.monotonic() + timeout
        view = SweepProgress.create(progress)
        try:
            while True:
                sweep = self.get(sweep_id)
                if view is not None:
                    view.update(sweep)
                if sweep.done:
                    return sweep
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeoutError(f"sweep {sweep_id} still {sweep.status} after {timeout}s",
                                           run_id=sweep_id, last=sweep)
                time.sleep(poll_interval_s if deadline is None
                           else max(0.0, min(poll_interval_s, deadline - time.monotonic())))
        finally:
            if view is not None:
                view.close()


# ---------------------------------------------------------------------------------------------- cluster
class ClusterResource(_Resource):
    def get(self) -> ClusterPublic:
        """Nodes, free/total CPUs and GPUs of the service's Ray cluster, and its dashboard URL."""
        return tolerant_validate(ClusterPublic, self._client.request("GET", "/v1/cluster"))
