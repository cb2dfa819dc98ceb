"""Live progress views for ``wait(progress=True)`` (rich is imported only when a view is shown).

On a terminal: a live view of two parts: the run (or sweep) and its status as wrapped text (never cut with "…": a
run id or a link in a status stays whole), then a bar with the numbers. On anything else (a pipe, a CI log, a
file): plain lines, no redraws and no colour, one per status change and one per tenth of the steps, each printed
whole whatever the width.
"""

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


def _live(console: Any, *columns: Any, refresh_per_second: float) -> Any:
    """A rich ``Progress`` that shows each task as its heading (``task.fields["head"]``: wrapped text, never
    ellipsized) above a row of ``columns``."""
    from rich.progress import Progress
    from rich.text import Text

    class _HeadedProgress(Progress):
        def get_renderables(self) -> Any:
            for task in self.tasks:
                if task.visible:
                    yield Text(str(task.fields.get("head", "")), overflow="fold")
                    yield self.make_tasks_table([task])

    return _HeadedProgress(
        *columns, console=console, transient=False, refresh_per_second=refresh_per_second, expand=False
    )


class _Lines:
    """Progress as plain lines, each printed once and whole (``soft_wrap``: the reader's terminal, if any, wraps)."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self._last: dict[str, str] = {}

    def once(self, key: str, text: str) -> None:
        if self._last.get(key) != text:
            self._last[key] = text
            self.console.print(text, soft_wrap=True, markup=False, highlight=False)


class RunProgress:
    """step/total bar with loss, tokens/s (``now``: the latest step's; ``mean``: over every step so far, the slow
    first steps included: the same mean as the run summary's "tokens/s (mean of all steps)") and ETA, fed by
    incremental metric rows; before the first step, the run's start-up phase and its elapsed time."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._lines = None if console.is_terminal else _Lines(console)
        self._next_line_step = 0
        self._progress = _live(
            console,
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("tok/s now {task.fields[tps]} mean {task.fields[mean_tps]}"),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TimeElapsedColumn(),
            refresh_per_second=4,
        )
        self._task: Any = None
        self._seen = 0
        self._tps_sum = 0.0
        if self._lines is None:
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
        head = f"{run.name} ({run.id}): {status}"
        if self._task is None:
            self._task = self._progress.add_task(
                "", total=total, loss="-", tps="-", mean_tps="-", status=status, head=head
            )
        fields: dict[str, Any] = {"status": status, "head": head}
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
        if self._lines is not None:
            self._print_lines(run, total, bool(rows))

    def _print_lines(self, run: Any, total: int, new_rows: bool) -> None:
        assert self._lines is not None
        task = self._progress.tasks[0]
        f = task.fields
        self._lines.once("status", f"{run.name} ({run.id}): {f['status']}")
        step = int(task.completed)
        if new_rows and (step >= self._next_line_step or step >= total):
            self._next_line_step = step + max(1, total // 10)
            self._lines.once(
                "step", f"{run.id} step {step}/{total}  loss {f['loss']}  tok/s now {f['tps']} mean {f['mean_tps']}"
            )

    def close(self) -> None:
        if self._lines is None:
            self._progress.stop()


class SweepProgress:
    """trials finished / to run (skipped ones counted apart), with the best measured tokens/s so far."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        self._lines = None if console.is_terminal else _Lines(console)
        self._progress = _live(
            console,
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("trials ({task.fields[skipped]} skipped)"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[head]}"),
            refresh_per_second=2,
        )
        self._task: Any = None
        if self._lines is None:
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
        now = [f"trial {t.id} {layout_label(t.layout)} mb{t.micro_batch_size} {t.phase}" for t in sweep.trials
               if t.phase]  # fmt: skip
        head = f"sweep {sweep.name} ({sweep.id}): {sweep.status}, best {best}" + (f"; {', '.join(now)}" if now else "")
        if self._task is None:
            self._task = self._progress.add_task("", total=total, skipped=skipped, head=head)
        self._progress.update(self._task, completed=finished, total=total, skipped=skipped, head=head)
        if self._lines is not None:
            self._lines.once("sweep", f"{head}; {finished}/{total} trials finished ({skipped} skipped)")

    def close(self) -> None:
        if self._lines is None:
            self._progress.stop()
