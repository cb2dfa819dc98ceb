"""Resources of the client (``client.runs``, ``client.plans``, ``client.sweeps``, ``client.cluster``) and the
objects they return: the api.spec response models, with a few convenience methods bound to the client."""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, PrivateAttr

from api.spec import (
    CheckpointList,
    CheckpointPublic,
    ClusterPublic,
    EventList,
    EventPublic,
    Layout,
    LogsPublic,
    MetricList,
    MetricRow,
    PlanResponse,
    RunBreakdown,
    RunGoodput,
    RunList,
    RunPublic,
    RunSpec,
    RunStatus,
    SweepEventList,
    SweepEventPublic,
    SweepList,
    SweepPublic,
)
from api.spec.metrics import METRIC_ROW_FIELDS

from ._base import tolerant_validate
from ._errors import ConflictError, RunFailedError, WaitTimeoutError
from ._observe import RunDiagnostics
from ._specs import SpecInput, apply_overrides, parse_layout, to_body

if TYPE_CHECKING:  # pragma: no cover
    import pandas

    from .client import Client

log = logging.getLogger("meshrun.client")

SWEEP_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
_RESUMABLE_STATES = frozenset({RunStatus.FAILED.value, RunStatus.CANCELLED.value})
_RESUMED_STATES = frozenset({RunStatus.QUEUED.value, RunStatus.STARTING.value, RunStatus.RUNNING.value})


def metric_rows_frame(rows: Iterable[MetricRow]) -> pandas.DataFrame:
    """Metric rows as a pandas DataFrame indexed by step, one column per field of ``MetricRow`` (needs pandas)."""
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("metrics_df() needs pandas: pip install pandas (or use metrics() for rows)") from e
    return pd.DataFrame([r.model_dump() for r in rows], columns=list(METRIC_ROW_FIELDS)).set_index("step")


# ----------------------------------------------------------------------------------------------- objects
class Run(RunPublic):
    """A run as the API returns it (``RunPublic``) plus methods that call back into the client."""

    _client: Any = PrivateAttr(default=None)

    def _bind(self, client: Client) -> Run:
        self._client = client
        return self

    def _replace(self, other: Run) -> Run:
        for name in type(self).model_fields:
            object.__setattr__(self, name, getattr(other, name))
        return self

    @property
    def done(self) -> bool:
        return RunStatus(self.status).terminal

    def refresh(self) -> Run:
        """Re-read the run from the service (in place) and return it."""
        return self._replace(self._client.runs.get(self.id))

    def wait(
        self,
        *,
        progress: bool | Any = False,
        timeout: float | None = None,
        poll_interval_s: float = 1.0,
        raise_on_failure: bool = False,
    ) -> Run:
        """Block until the run finishes; see ``client.runs.wait``. Updates this object and returns it."""
        final = self._client.runs.wait(
            self.id,
            progress=progress,
            timeout=timeout,
            poll_interval_s=poll_interval_s,
            raise_on_failure=raise_on_failure,
        )
        return self._replace(final)

    def metrics(self, *, since_step: int = 0, attempt: int | None = None) -> list[MetricRow]:
        return self._client.runs.metrics(self.id, since_step=since_step, attempt=attempt)

    def series(self, *, points: int = 500, field: str = "loss") -> MetricList:
        return self._client.runs.series(self.id, points=points, field=field)

    def metrics_df(self, *, since_step: int = 0, attempt: int | None = None) -> pandas.DataFrame:
        return self._client.runs.metrics_df(self.id, since_step=since_step, attempt=attempt)

    def events(self) -> list[EventPublic]:
        return self._client.runs.events(self.id)

    def breakdown(self) -> RunBreakdown:
        return self._client.runs.breakdown(self.id)

    def logs(self) -> str:
        return self._client.runs.logs(self.id)

    def checkpoints(self) -> list[CheckpointPublic]:
        return self._client.runs.checkpoints(self.id)

    def goodput(self) -> RunGoodput:
        return self._client.runs.goodput(self.id)

    def cancel(self) -> Run:
        return self._replace(self._client.runs.cancel(self.id))

    def resume(
        self,
        *,
        layout: Layout | dict[str, Any] | str | None = None,
        batch: Any = None,
        steps: int | None = None,
        fresh: bool = False,
    ) -> Run:
        return self._replace(self._client.runs.resume(self.id, layout=layout, batch=batch, steps=steps, fresh=fresh))


class RunPage(RunList):
    """One page of ``client.runs.list``: ``items`` (Run objects), ``total`` (counted up to 1,000), ``limit``,
    and ``next_cursor`` (pass it as ``cursor`` for the next page; None on the last)."""

    items: list[Run]  # type: ignore[assignment]


class Sweep(SweepPublic):
    """A sweep as the API returns it (``SweepPublic``) plus client-bound methods."""

    _client: Any = PrivateAttr(default=None)

    def _bind(self, client: Client) -> Sweep:
        self._client = client
        return self

    def _replace(self, other: Sweep) -> Sweep:
        for name in type(self).model_fields:
            object.__setattr__(self, name, getattr(other, name))
        return self

    @property
    def done(self) -> bool:
        return str(self.status).upper() in SWEEP_TERMINAL

    def refresh(self) -> Sweep:
        return self._replace(self._client.sweeps.get(self.id))

    def wait(
        self, *, progress: bool | Any = False, timeout: float | None = None, poll_interval_s: float = 2.0
    ) -> Sweep:
        return self._replace(
            self._client.sweeps.wait(self.id, progress=progress, timeout=timeout, poll_interval_s=poll_interval_s)
        )

    def cancel(self) -> Sweep:
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
def _status_values(status: Any) -> list[str] | None:
    if status is None:
        return None
    if isinstance(status, (str, RunStatus)):
        status = [status]
    return [(s.value if isinstance(s, RunStatus) else str(s)).upper() for s in status]


class _Resource:
    def __init__(self, client: Client) -> None:
        self._client = client


# ------------------------------------------------------------------------------------------------- runs
class Runs(RunDiagnostics, _Resource):
    def create(
        self,
        spec: SpecInput,
        *,
        overrides: Iterable[str] = (),
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Submit a run. ``spec``: a ``RunSpec``, a dict, or a path to a YAML/JSON file; ``overrides``:
        ``["layout.tp=2", "train.steps=20"]``. The POST carries an idempotency key (generated unless given),
        so retries never create a second run; passing your own key makes re-submission safe across
        processes too."""
        body = apply_overrides(to_body(spec), overrides)
        data = self._client.request("POST", "/v1/runs", json=body, idempotency_key=idempotency_key, timeout=timeout)
        return tolerant_validate(Run, data)._bind(self._client)

    def get(self, run_id: str) -> Run:
        return tolerant_validate(Run, self._client.request("GET", f"/v1/runs/{run_id}"))._bind(self._client)

    def list(
        self,
        *,
        status: str | RunStatus | Iterable[str | RunStatus] | None = None,
        name: str | None = None,
        sweep_id: str | None = None,
        limit: int = 50,
        offset: int = 0,
        cursor: str | None = None,
    ) -> RunPage:
        """One page, newest first. Continue with ``cursor=page.next_cursor`` (or use ``iter``)."""
        params = {
            "status": _status_values(status),
            "name": name,
            "sweep_id": sweep_id,
            "limit": limit,
            "offset": offset or None,
            "cursor": cursor,
        }
        page = tolerant_validate(RunPage, self._client.request("GET", "/v1/runs", params=params))
        for r in page.items:
            r._bind(self._client)
        return page

    def iter(
        self, *, status: Any = None, name: str | None = None, sweep_id: str | None = None, page_size: int = 100
    ) -> Iterator[Run]:
        """Every matching run, newest first, fetching pages (by cursor) as needed."""
        cursor: str | None = None
        while True:
            page = self.list(status=status, name=name, sweep_id=sweep_id, limit=page_size, cursor=cursor)
            yield from page.items
            cursor = page.next_cursor
            if not page.items or not cursor:
                return

    def iter_metrics(
        self, run_id: str, *, since_step: int = 0, attempt: int | None = None, page_size: int = 5000
    ) -> Iterator[MetricRow]:
        """Per-step metric rows (step > since_step) in step order, each step once, fetched page by page."""
        cursor: str | None = None
        while True:
            params = {"since_step": since_step or None, "attempt": attempt, "limit": page_size, "cursor": cursor}
            data = self._client.request("GET", f"/v1/runs/{run_id}/metrics", params=params)
            if isinstance(data, list):  # a service from before pages
                yield from (tolerant_validate(MetricRow, r) for r in data)
                return
            page = tolerant_validate(MetricList, data)
            yield from page.items
            cursor = page.next_cursor
            if not page.items or not cursor:
                return

    def metrics(self, run_id: str, *, since_step: int = 0, attempt: int | None = None) -> builtins.list[MetricRow]:
        """Per-step metric rows (step > since_step), each step once (the latest attempt's), all pages."""
        return list(self.iter_metrics(run_id, since_step=since_step, attempt=attempt))

    def series(self, run_id: str, *, points: int = 500, field: str = "loss") -> MetricList:
        """A downsampled series for charts: at most ``points`` rows over the whole run, keeping the smallest and
        largest ``field`` of each bucket (``series_rows``: rows in the full series)."""
        data = self._client.request("GET", f"/v1/runs/{run_id}/metrics", params={"points": points, "field": field})
        return tolerant_validate(MetricList, data)

    def metrics_df(self, run_id: str, *, since_step: int = 0, attempt: int | None = None) -> pandas.DataFrame:
        """The metrics as a pandas DataFrame indexed by step (needs pandas: pip install pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("metrics_df() needs pandas: pip install pandas (or use metrics() for rows)") from e
        columns = list(MetricRow.model_fields)
        frames = []
        rows: list[dict[str, Any]] = []
        for r in self.iter_metrics(run_id, since_step=since_step, attempt=attempt):
            rows.append(r.model_dump())
            if len(rows) >= 5000:  # one frame per page-sized chunk: no list of every row's dict at once
                frames.append(pd.DataFrame(rows, columns=columns))
                rows = []
        if rows or not frames:
            frames.append(pd.DataFrame(rows, columns=columns))
        df = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        return df.set_index("step")

    def events(self, run_id: str, *, kind: str | Iterable[str] | None = None) -> builtins.list[EventPublic]:
        """Every event of the run (oldest first), all pages; ``kind`` keeps only those kinds."""
        kinds = [kind] if isinstance(kind, str) else (list(kind) if kind is not None else None)
        out: list[EventPublic] = []
        cursor: str | None = None
        while True:
            params = {"kind": kinds, "limit": 1000, "cursor": cursor}
            data = self._client.request("GET", f"/v1/runs/{run_id}/events", params=params)
            if isinstance(data, list):
                return [tolerant_validate(EventPublic, e) for e in data]
            page = tolerant_validate(EventList, data)
            out.extend(page.items)
            cursor = page.next_cursor
            if not page.items or not cursor:
                return out

    def logs_page(
        self, run_id: str, *, cursor: str | None = None, tail: bool = False, limit: int | None = None
    ) -> LogsPublic:
        """One page of the run's output: from ``cursor`` (a page's ``next_cursor``: also how to follow new
        output), else from the start, or its last ``limit`` characters with ``tail``."""
        params = {"cursor": cursor, "tail": tail or None, "limit": limit}
        data = self._client.request("GET", f"/v1/runs/{run_id}/logs", params=params)
        if isinstance(data, str):
            return LogsPublic(run_id=run_id, logs=data, total_chars=len(data))
        return tolerant_validate(LogsPublic, data)

    def logs(self, run_id: str) -> str:
        """The run's whole output so far (every page)."""
        parts: list[str] = []
        cursor: str | None = None
        while True:
            page = self.logs_page(run_id, cursor=cursor)
            parts.append(page.logs)
            cursor = page.next_cursor
            if not page.has_more or not cursor or not page.logs:
                return "".join(parts)

    def goodput(self, run_id: str) -> RunGoodput:
        """Productive step time / wall time since submission, and the seconds lost per cause."""
        return tolerant_validate(RunGoodput, self._client.request("GET", f"/v1/runs/{run_id}/goodput"))

    def checkpoints(self, run_id: str) -> builtins.list[CheckpointPublic]:
        """Every checkpoint of the run by step, all pages."""
        out: list[CheckpointPublic] = []
        cursor: str | None = None
        while True:
            data = self._client.request(
                "GET", f"/v1/runs/{run_id}/checkpoints", params={"limit": 500, "cursor": cursor}
            )
            if isinstance(data, list):
                return [tolerant_validate(CheckpointPublic, c) for c in data]
            page = tolerant_validate(CheckpointList, data)
            out.extend(page.items)
            cursor = page.next_cursor
            if not page.items or not cursor:
                return out

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

    def resume(
        self,
        run_id: str,
        *,
        layout: Layout | dict[str, Any] | str | None = None,
        batch: Any = None,
        steps: int | None = None,
        fresh: bool = False,
        idempotency_key: str | None = None,
    ) -> Run:
        """Resume a stopped run from its latest checkpoint, optionally on a new ``layout`` (``"dp=2,tp=1"``,
        a dict or a Layout; the checkpoint is resharded), ``batch`` or total ``steps`` (a longer horizon continues
        the LR schedule without a jump). A run without a checkpoint is refused (409) unless ``fresh=True``: start
        again from step 0."""
        body: dict[str, Any] = {}
        if fresh:
            body["fresh"] = True
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
            data = self._client.request(
                "POST",
                f"/v1/runs/{run_id}/resume",
                json=body,
                idempotency_key=idempotency_key,
                on_retry=lambda: retried.append(1),
            )
        except ConflictError:
            if retried and before is not None:
                run = self.get(run_id)
                if RunStatus(run.status).value in _RESUMED_STATES and (
                    RunStatus(before.status).value in _RESUMABLE_STATES or (run.attempts or 0) > (before.attempts or 0)
                ):
                    log.info(
                        "resume of %s was retried and the run is %s again: an earlier attempt did it",
                        run_id,
                        RunStatus(run.status).value,
                    )
                    return run
            raise
        return tolerant_validate(Run, data)._bind(self._client)

    def wait(
        self,
        run_id: str,
        *,
        progress: bool | Any = False,
        timeout: float | None = None,
        poll_interval_s: float = 1.0,
        raise_on_failure: bool = False,
    ) -> Run:
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
                    raise WaitTimeoutError(
                        f"run {run_id} still {run.status.value} after {timeout}s", run_id=run_id, last=run
                    )
                wait_s = (
                    poll_interval_s if deadline is None else max(0.0, min(poll_interval_s, deadline - time.monotonic()))
                )
                time.sleep(wait_s)
        finally:
            if view is not None:
                view.close()
        if raise_on_failure and run.status != RunStatus.SUCCEEDED:
            raise RunFailedError(run)
        return run


# ------------------------------------------------------------------------------------------------ plans
class Plans(_Resource):
    def create(
        self,
        request: SpecInput | None = None,
        *,
        model: Any = None,
        cluster: Any = None,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        precision: Literal["fp32", "bf16", "fp16"] | None = None,
        top_k: int | None = None,
        layout: Layout | dict[str, Any] | str | None = None,
        micro_batch_size: int | None = None,
        activation_checkpointing: str | None = None,
        steps: int | None = None,
        rank_by: Literal["time", "cost"] | None = None,
    ) -> PlanResponse:
        """Ask the planner for the best layouts (or to score one ``layout``). Give a ``PlanRequest`` (model,
        dict, file) or the fields as keywords, e.g. ``model={"name": "gpt", "preset": "7b"},
        cluster={"device": "H100", "gpus_per_node": 8, "nodes": 4, "price_per_device_hour": 2.5},
        global_batch_size=512, steps=10_000, rank_by="cost"``; keywords override the request's fields."""
        body: dict[str, Any] = to_body(request) if request is not None else {}
        if isinstance(layout, str):
            layout = parse_layout(layout)
        for key, value in (
            ("model", model),
            ("cluster", cluster),
            ("global_batch_size", global_batch_size),
            ("seq_len", seq_len),
            ("precision", precision),
            ("top_k", top_k),
            ("layout", layout),
            ("micro_batch_size", micro_batch_size),
            ("activation_checkpointing", activation_checkpointing),
            ("steps", steps),
            ("rank_by", rank_by),
        ):
            if value is not None:
                body[key] = to_body(value) if isinstance(value, BaseModel) else value
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

    def list(
        self, *, status: str | None = None, limit: int = 50, offset: int = 0, cursor: str | None = None
    ) -> SweepPage:
        """One page, newest first; continue with ``cursor=page.next_cursor`` (or use ``iter``)."""
        params = {"status": status, "limit": limit, "offset": offset or None, "cursor": cursor}
        page = tolerant_validate(SweepPage, self._client.request("GET", "/v1/sweeps", params=params))
        for s in page.items:
            s._bind(self._client)
        return page

    def iter(self, *, status: str | None = None, page_size: int = 50) -> Iterator[Sweep]:
        """Every matching sweep, newest first, fetching pages as needed."""
        cursor: str | None = None
        while True:
            page = self.list(status=status, limit=page_size, cursor=cursor)
            yield from page.items
            cursor = page.next_cursor
            if not page.items or not cursor:
                return

    def cancel(self, sweep_id: str) -> Sweep:
        data = self._client.request("POST", f"/v1/sweeps/{sweep_id}/cancel")
        return tolerant_validate(Sweep, data)._bind(self._client)

    def events(self, sweep_id: str) -> builtins.list[SweepEventPublic]:
        """The sweep's and its trials' state changes (``trial_id`` None for the sweep's own), oldest first."""
        data = self._client.request("GET", f"/v1/sweeps/{sweep_id}/events")
        return tolerant_validate(SweepEventList, data).items

    def wait(
        self, sweep_id: str, *, progress: bool | Any = False, timeout: float | None = None, poll_interval_s: float = 2.0
    ) -> Sweep:
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
                    raise WaitTimeoutError(
                        f"sweep {sweep_id} still {sweep.status} after {timeout}s", run_id=sweep_id, last=sweep
                    )
                time.sleep(
                    poll_interval_s if deadline is None else max(0.0, min(poll_interval_s, deadline - time.monotonic()))
                )
        finally:
            if view is not None:
                view.close()


# ---------------------------------------------------------------------------------------------- cluster
class ClusterResource(_Resource):
    def get(self) -> ClusterPublic:
        """Nodes, free/total CPUs and GPUs of the service's Ray cluster, and its dashboard URL."""
        return tolerant_validate(ClusterPublic, self._client.request("GET", "/v1/cluster"))
