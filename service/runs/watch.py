"""What the run driver watches while a run trains (pure logic, no Ray, no database; the lifecycle acts on it).

``StragglerWatch``: a rank whose COMPUTE time stays well above the median of its peers' for several measured
steps in a row is a straggler. Compute, not step time: a rank that waits for a slow peer spends the wait in
communication (or the pipeline bubble), so it is never blamed. One alert per episode: after an alert the rank must
come back under the threshold before it can be named again.

``HangWatch``: no rank finished a step for ``timeout_s`` (from the ranks' heartbeats, ``workers.diagnostics``). The
timeout is the spec's ``resources.hang_timeout_s`` or, when unset, derived from the measured step times:
``api.spec.run.hang_limit_s``: max(300 s, 20 x the slowest step seen). Nothing is declared before the attempt's first
step (model build, compile and checkpoint loading have no step time to compare with).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from api.spec.run import hang_limit_s

STRAGGLER_RATIO = 1.5  # compute above 1.5x the peers' median ...
STRAGGLER_STEPS = 5  # ... for this many measured steps in a row


@dataclass(frozen=True)
class Straggler:
    rank: int
    first_step: int
    last_step: int
    compute_s: float  # median over the episode
    peers_s: float  # median of the peers' compute over the episode

    def describe(self, node: str | None = None, host: str | None = None) -> str:
        where = f" on node {node[:12]}" if node else ""
        if host:
            where += f" ({host})"
        extra = self.compute_s - self.peers_s
        ratio = self.compute_s / self.peers_s if self.peers_s > 0 else float("inf")
        return (
            f"rank {self.rank}{where} is a straggler: compute {self.compute_s * 1000:.1f} ms per step vs "
            f"{self.peers_s * 1000:.1f} ms median of its peers (+{extra * 1000:.1f} ms, {ratio:.1f}x) over steps "
            f"{self.first_step}-{self.last_step}"
        )


@dataclass
class StragglerWatch:
    ratio: float = STRAGGLER_RATIO
    steps: int = STRAGGLER_STEPS
    _streak: dict[int, list[tuple[int, float, float]]] = field(default_factory=dict)
    _alerted: set[int] = field(default_factory=set)

    def reset(self) -> None:
        """A new attempt (new processes, maybe new nodes)."""
        self._streak.clear()
        self._alerted.clear()

    def observe(self, step: int, compute_per_rank: list[float]) -> list[Straggler]:
        """One measured step (compute seconds per rank); returns the stragglers this step confirms."""
        n = len(compute_per_rank)
        if n < 2:
            return []
        found = []
        for r, c in enumerate(compute_per_rank):
            peers = statistics.median(compute_per_rank[:r] + compute_per_rank[r + 1 :])
            if peers > 0 and c > self.ratio * peers:
                streak = self._streak.setdefault(r, [])
                streak.append((step, c, peers))
                if len(streak) >= self.steps and r not in self._alerted:
                    self._alerted.add(r)
                    found.append(
                        Straggler(
                            rank=r,
                            first_step=streak[0][0],
                            last_step=step,
                            compute_s=statistics.median(x[1] for x in streak),
                            peers_s=statistics.median(x[2] for x in streak),
                        )
                    )
            else:
                self._streak.pop(r, None)
                self._alerted.discard(r)
        return found


@dataclass
class HangWatch:
    """Feed it the attempt's latest rank snapshots and the measured step times; ``hung(now)`` says when to act."""

    timeout_s: float | None = None  # the spec's; None: derived
    attempt: int | None = None
    steps_done: int = 0
    progress_at: float | None = None  # monotonic time the steps_done last grew
    slowest_step_s: float = 0.0
    fired: bool = False

    def effective_timeout_s(self) -> float:
        return hang_limit_s(self.timeout_s, self.slowest_step_s)

    def step_time(self, seconds: float | None) -> None:
        if seconds is not None and seconds > self.slowest_step_s:
            self.slowest_step_s = float(seconds)

    def states(self, attempt: int, snapshots: list[dict[str, object]], now: float) -> None:
        if attempt != self.attempt:
            self.attempt, self.steps_done, self.progress_at, self.fired = attempt, 0, None, False
        done = max((int(str(s.get("steps_done") or 0)) for s in snapshots), default=0)
        if done > self.steps_done:
            self.steps_done, self.progress_at = done, now
        if any(s.get("phase") in ("done", "failed") for s in snapshots):
            self.progress_at = None  # finishing or failing: Ray Train takes it from here

    def hung(self, now: float) -> bool:
        if self.fired or self.progress_at is None or self.steps_done < 1:
            return False
        return now - self.progress_at > self.effective_timeout_s()
