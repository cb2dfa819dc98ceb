"""Early stopping: clearly slower trials are stopped once they have a few measured steps; contenders run on."""

from __future__ import annotations

from ray.tune.schedulers import TrialScheduler

from service.sweeps.driver import SlowTrialStopper

C, S = TrialScheduler.CONTINUE, TrialScheduler.STOP


def r(v, n, **kw):
    return {"objective": v, "steps_measured": n, **kw}


def test_first_trial_runs_to_the_end():
    st = SlowTrialStopper(grace_steps=2)
    assert [st.decide("a", r(100.0, n)) for n in (1, 2, 3, 4)] == [C, C, C, C]


def test_clearly_slower_trial_is_stopped_after_grace_with_a_reason():
    st = SlowTrialStopper(grace_steps=2, ratio=0.5)
    st.decide("a", r(100.0, 4, final=True), label="trial 1")
    assert st.decide("b", r(30.0, 1), label="trial 2") == C  # grace: one measured step is not enough
    assert st.decide("b", r(30.0, 2), label="trial 2") == S
    assert "30" in st.reasons["b"] and "100" in st.reasons["b"] and "trial 1" in st.reasons["b"]


def test_a_contender_is_not_stopped():
    st = SlowTrialStopper(grace_steps=2, ratio=0.5)
    st.decide("a", r(100.0, 4, final=True))
    assert [st.decide("b", r(v, n)) for v, n in ((70.0, 1), (60.0, 2), (55.0, 3))] == [C, C, C]
    assert "b" not in st.reasons


def test_failed_and_unmeasured_reports_are_ignored():
    st = SlowTrialStopper(grace_steps=1)
    st.decide("a", r(100.0, 3))
    assert st.decide("b", r(0.0, 0, final=True, failed=True)) == C
    assert st.decide("c", r(1.0, 2, final=True)) == C  # a finished trial is recorded, not stopped
    assert st.latest["c"] == 1.0 and "b" not in st.latest


def test_driver_callback_and_scheduler_pickle():
    """Tune pickles its callbacks and scheduler with the experiment state: plain data only."""
    from ray import cloudpickle  # what Tune pickles with (cloudpickle itself is not a dependency)

    from service.sweeps.driver import TrialRecorder

    cb = TrialRecorder("sqlite:////tmp/meshrun-pickle-test.db", "sweep-x", SlowTrialStopper())
    assert cb.factory is not None
    again = cloudpickle.loads(cloudpickle.dumps(cb))
    assert again.sweep_id == "sweep-x" and again.stopper.ratio == 0.5


class _Trial:
    def __init__(self, tid, sweep_trial_id):
        self.trial_id, self.config = tid, {"trial_id": sweep_trial_id}


def test_stop_is_graceful_first_then_hard_if_the_trial_keeps_going():
    calls = []
    st = SlowTrialStopper(grace_steps=1, on_stop=lambda *a: calls.append(a), hard_after=2)
    st.on_trial_result(None, _Trial("a", 1), r(100.0, 4, final=True))
    slow = _Trial("b", 2)
    assert st.on_trial_result(None, slow, r(10.0, 1, run_id="run-b")) == C  # asked to stop, not killed
    assert calls == [(2, "run-b", st.reasons["b"])]
    assert st.on_trial_result(None, slow, r(10.0, 2, run_id="run-b")) == C
    assert st.on_trial_result(None, slow, r(10.0, 3, run_id="run-b")) == S  # still going: Tune stops it
    assert len(calls) == 1
    assert st.on_trial_result(None, slow, r(10.0, 3, final=True)) == C


def test_a_failing_graceful_stop_falls_back_to_tune():
    def boom(*a):
        raise RuntimeError("channel gone")

    st = SlowTrialStopper(grace_steps=1, on_stop=boom)
    st.on_trial_result(None, _Trial("a", 1), r(100.0, 4, final=True))
    assert st.on_trial_result(None, _Trial("b", 2), r(10.0, 1)) == S
