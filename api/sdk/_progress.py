"""Live progress views for ``wait(progress=True)`` (rich is imported only when a view is shown)."""

from __future__ import annotations

from typing import Any

from api.spec import RunStatus


def _console(progress: Any) -> Any:
    from rich.console import Console

    if isinstance(progress, Console):
        return progress
    return Console(stderr=True)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


class RunProgress:
    """step/total bar with loss, tokens/s (``now``: the latest step's; ``mean``: over every step so far, the slow
    first steps included: the same mean as the run summary's "tokens/s (mean of all steps)") and ETA, fed by
    incremental metric rows; before the first step, the run's start-up phase and its elapsed time."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("tok/s now {task.fields[tps]} mean {task.fields[mean_tps]}"),
            TextColumn("{task.fields[status]}"),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            refresh_per_second=4,
        )
        self._task: Any = None
        self._seen = 0
        self._tps_sum = 0.0
        self._progress.start()

    @classmethod
    def create(cls, progress: Any) -> RunProgress | None:
        if not progress:
            return None
        return cls(_console(progress))

    def update(self, run: Any, rows: list[Any]) -> None:
        total = run.spec.train.steps
        status = RunStatus(run.status).value
        if not self._seen and not RunStatus(run.status).terminal and run.status_reason:
            # before the first step: the start-up phase (queued and why, starting the Ray Job, placing N workers,
            # workers ready) with its elapsed time
            status = f"{status}: {run.status_reason}"
        if self._task is None:
            self._task = self._progress.add_task(
                f"{run.name} ({run.id})", total=total, loss="-", tps="-", mean_tps="-", status=status
            )
        fields: dict[str, Any] = {"status": status}
        if rows:
            self._seen += len(rows)
            last = rows[-1]
            fields["loss"] = f"{last.loss:.4f}" if last.loss is not None else "-"
            fields["tps"] = _fmt_rate(last.tokens_per_s)  # instantaneous: the latest step's
            self._tps_sum += sum(r.tokens_per_s or 0.0 for r in rows)
            fields["mean_tps"] = _fmt_rate(self._tps_sum / self._seen)  # mean over every step seen so far
            total = max(total, last.step)
            self._progress.update(self._task, completed=last.step, total=total, **fields)
        else:
            self._progress.update(self._task, total=total, **fields)

    def close(self) -> None:
        self._progress.stop()


class SweepProgress:
    """trials finished / to run (skipped ones counted apart), with the best measured tokens/s so far."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("trials ({task.fields[skipped]} skipped)  best {task.fields[best]}"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            refresh_per_second=2,
        )
        self._task: Any = None
        self._progress.start()

    @classmethod
    def create(cls, progress: Any) -> SweepProgress | None:
        if not progress:
            return None
        return cls(_console(progress))

    def update(self, sweep: Any) -> None:
        from api.spec.layout import layout_label

        statuses = [str(t.status).upper() for t in sweep.trials]
        skipped = statuses.count("SKIPPED")  # decided before anything ran: not progress
        total = len(statuses) - skipped
        finished = sum(1 for st in statuses if st not in ("PENDING", "QUEUED", "RUNNING", "STARTING", "SKIPPED"))
        best = "-"
        if sweep.best_trial is not None:
            bt = sweep.best_trial
            best = f"{layout_label(bt.layout)} mb{bt.micro_batch_size} {_fmt_rate(bt.measured_tokens_per_s)} tok/s"
        if self._task is None:
            self._task = self._progress.add_task(
                f"sweep {sweep.name} ({sweep.id})", total=total, best=best, status=sweep.status, skipped=skipped
            )
        self._progress.update(
            self._task, completed=finished, total=total, best=best, status=sweep.status, skipped=skipped
        )

    def close(self) -> None:
        self._progress.stop()
