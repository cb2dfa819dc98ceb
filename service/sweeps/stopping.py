"""Early stopping of a sweep's clearly slower trials (a Ray Tune scheduler), gracefully.

``SlowTrialStopper`` decides (``decide`` is pure apart from its own bookkeeping); ``GracefulStop`` acts: it writes
the reason on the trial and asks the trial's workers, through its run's channel actor, to stop after their current
step (rank 0 polls the channel's ``control()`` at each report, ``workers.ray_worker``), so the Train run ends
normally and releases its placement group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.tune.experiment import Trial as TuneTrial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from service.cluster.jobs import channel_name
from service.store.db import shared_sessionmaker
from service.sweeps.trials import note_stop_request

logger = logging.getLogger(__name__)

EARLY_STOP_RATIO = 0.5
MIN_MEASURED_STEPS = 3


def early_stop_grace(measured_steps: int) -> int:
    """The rule: a trial can be stopped early only after max(3, half its measured steps) measured (post-warm-up)
    steps, and only when its running mean is below ``EARLY_STOP_RATIO`` (0.5) x the best objective another trial
    reported. Fewer than 3 measured steps are noise: a sweep with fewer measured steps per trial never stops one."""
    return max(MIN_MEASURED_STEPS, measured_steps // 2)


METRIC = "objective"
TIME_ATTR = "steps_measured"
STOP_REQUEST_TIMEOUT_S = 10.0


class SlowTrialStopper(FIFOScheduler):
    """Stop clearly slower trials: once a trial has ``grace_steps`` measured (post-warm-up) steps, it is stopped
    if its running mean objective is below ``ratio`` x the best objective another trial has reported (running
    or final). The reason is kept (``reasons[tune trial id]``).

    Stopping is graceful: ``on_stop(trial_id, run_id, reason)`` (``GracefulStop``) records the reason and asks the
    trial's workers, through the run's channel actor, to stop after their current step, so the Train run ends
    normally and releases its placement group at once (a Tune STOP kills the trial actor, and the Train placement
    group can outlive it: ray#54305). Tune is told STOP only if the trial keeps reporting ``hard_after`` more
    measured steps after the request."""

    def __init__(
        self,
        *,
        grace_steps: int = 2,
        ratio: float = EARLY_STOP_RATIO,
        metric: str = METRIC,
        time_attr: str = TIME_ATTR,
        on_stop: Callable[[int, str | None, str], None] | None = None,
        hard_after: int = 3,
    ):
        super().__init__()
        self.grace_steps, self.ratio, self.objective_key, self.time_attr = max(1, grace_steps), ratio, metric, time_attr
        self.on_stop, self.hard_after = on_stop, hard_after
        self.latest: dict[str, float] = {}
        self.labels: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.requested_at: dict[str, int] = {}

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return mode in (None, "max")

    def decide(self, trial_id: str, result: dict[str, Any], label: str = "") -> str:
        """STOP or CONTINUE for one result (pure: no side effects beyond this scheduler's bookkeeping)."""
        v, n = result.get(self.objective_key), int(result.get(self.time_attr) or 0)
        if v is None or result.get("failed") or not n:
            return TrialScheduler.CONTINUE
        others = {tid: x for tid, x in self.latest.items() if tid != trial_id}
        self.latest[trial_id] = float(v)
        if label:
            self.labels[trial_id] = label
        if result.get("final") or n < self.grace_steps or not others:
            return TrialScheduler.CONTINUE
        if trial_id in self.reasons:
            return TrialScheduler.STOP
        best_id = max(others, key=lambda tid: others[tid])
        if v < self.ratio * others[best_id]:
            self.reasons[trial_id] = (
                f"early-stopped: {self.objective_key} {v:.4g} after {n} measured steps is below "
                f"{self.ratio:.0%} of {others[best_id]:.4g} measured by "
                f"{self.labels.get(best_id, 'another trial')}"
            )
            return TrialScheduler.STOP
        return TrialScheduler.CONTINUE

    def on_trial_result(self, tune_controller: Any, trial: TuneTrial, result: dict[str, Any]) -> str:
        decision = self.decide(trial.trial_id, result, label=f"trial {trial.config.get('trial_id')}")
        if decision != TrialScheduler.STOP or self.on_stop is None:
            return decision
        n = int(result.get(self.time_attr) or 0)
        first = self.requested_at.setdefault(trial.trial_id, n)
        if first == n:
            try:
                self.on_stop(int(trial.config["trial_id"]), result.get("run_id"), self.reasons[trial.trial_id])
            except Exception:
                logger.exception("graceful stop of %s failed", trial)
                return TrialScheduler.STOP
        return TrialScheduler.STOP if n - first >= self.hard_after else TrialScheduler.CONTINUE


class GracefulStop:
    """``SlowTrialStopper.on_stop``: write the reason on the trial, ask its workers to stop (run channel).
    Plain data only (Tune pickles its scheduler with the experiment state)."""

    def __init__(self, database_url: str):
        self.database_url = database_url

    def __call__(self, trial_id: int, run_id: str | None, reason: str) -> None:
        run_id = note_stop_request(shared_sessionmaker(self.database_url), trial_id, reason) or run_id
        if run_id:
            ray.get(ray.get_actor(channel_name(run_id)).request_stop.remote(), timeout=STOP_REQUEST_TIMEOUT_S)
            logger.info("trial %s (run %s): stop requested: %s", trial_id, run_id, reason)
