"""service.store.goodput.account: the arithmetic of goodput and of the time lost per cause (pure, no database)."""

from __future__ import annotations

import pytest

from service.store.goodput import AttemptTimes, account


def test_a_run_with_a_failure_and_a_preemption_is_accounted_to_the_second() -> None:
    # t=0 submitted; 10 STARTING; attempt 1 steps 1..30 from 20 to 50; its worker error at 53; attempt 2 from 55
    # redoes steps 26..30 (5 s) and runs until 100; PREEMPTED 101, QUEUED 102, STARTING 110; attempt 3 from 112,
    # first step at 115, done at 135; SUCCEEDED at 136.
    states = [
        (0.0, "QUEUED"),
        (10.0, "STARTING"),
        (11.0, "RUNNING"),
        (101.0, "PREEMPTED"),
        (102.0, "QUEUED"),
        (110.0, "STARTING"),
        (111.0, "RUNNING"),
        (136.0, "SUCCEEDED"),
    ]
    attempts = [
        AttemptTimes(1, 12.0, 20.0, 50.0, 30.0, recomputed_s=5.0, recomputed_steps=5),
        AttemptTimes(2, 55.0, 60.0, 100.0, 40.0),
        AttemptTimes(3, 112.0, 115.0, 135.0, 20.0, checkpoint_stall_s=1.5),
    ]
    g = account(created=0.0, end=136.0, states=states, attempts=attempts, error_times=[53.0])
    lost = g["lost_s"]
    assert lost["queue"] == pytest.approx(10 + 8)
    assert lost["startup"] == pytest.approx(10)
    assert lost["failure_detection"] == pytest.approx(3)
    assert lost["restart"] == pytest.approx(7 + 1 + 5)  # error -> first step; stop after the notice; new job
    assert lost["recomputed_steps"] == pytest.approx(5)
    assert g["productive_s"] == pytest.approx(85)
    assert lost["checkpoint_stall"] == pytest.approx(1.5)
    assert lost["other"] == pytest.approx(136 - 85 - 18 - 10 - 3 - 13 - 5 - 1.5)
    per = {d["attempt"]: d for d in g["attempts_detail"]}
    assert per[1]["lost_s"]["startup"] == pytest.approx(10) and per[1]["productive_s"] == pytest.approx(25)
    assert per[2]["lost_s"]["failure_detection"] == pytest.approx(3) and per[2]["lost_s"]["restart"] == pytest.approx(7)
    assert per[3]["lost_s"]["restart"] == pytest.approx(6)
    assert per[3]["lost_s"]["checkpoint_stall"] == pytest.approx(1.5)
    for cause in ("startup", "failure_detection", "restart", "recomputed_steps", "checkpoint_stall"):
        assert sum(d["lost_s"][cause] for d in g["attempts_detail"]) == pytest.approx(lost[cause])
    assert g["goodput"] == pytest.approx(85 / 136)
    assert g["recomputed_steps"] == 5 and g["attempts"] == 3
    assert g["productive_s"] + sum(lost.values()) == pytest.approx(g["wall_s"])


def test_a_queued_run_has_no_goodput_yet_and_loses_only_queue_time() -> None:
    g = account(created=0.0, end=30.0, states=[(0.0, "QUEUED")], attempts=[])
    assert g["goodput"] == 0 and g["lost_s"]["queue"] == pytest.approx(30)
    assert account(created=5.0, end=5.0, states=[], attempts=[])["goodput"] is None


def test_the_cli_line_names_each_attempts_losses_when_there_are_several() -> None:
    from api.cli.runs import goodput_line
    from api.spec import RunGoodput

    states = [(0.0, "QUEUED"), (10.0, "STARTING"), (11.0, "RUNNING"), (136.0, "SUCCEEDED")]
    attempts = [
        AttemptTimes(1, 12.0, 20.0, 50.0, 30.0, recomputed_s=5.0, recomputed_steps=5),
        AttemptTimes(2, 55.0, 60.0, 135.0, 75.0, checkpoint_stall_s=1.5),
    ]
    g = RunGoodput.model_validate(
        {"run_id": "r", "status": "SUCCEEDED", **account(created=0.0, end=136.0, states=states, attempts=attempts,
                                                         error_times=[53.0])}  # fmt: skip
    )
    line = goodput_line(g)
    assert line.startswith(f"{g.goodput:.1%} of 136 s; lost: startup 10 s, failure detection 3 s, restart 7 s")
    assert line.endswith("; per attempt: #1 25 s (startup 10 s, recomputed steps 5 s); #2 75 s (failure detection 3 s, "
                         "restart 7 s, checkpoint stall 2 s)"), line


def test_replica_mode_waits_count_as_detection_and_restart_and_the_cli_names_each_replica() -> None:
    """A replica-mode run keeps one attempt: its rows' recovery and rejoin waits are its failure detection and
    restart, and the CLI line lists what each replica trained and how long it was out."""
    from api.cli.runs import goodput_line
    from api.spec import RunGoodput

    states = [(0.0, "QUEUED"), (1.0, "STARTING"), (2.0, "RUNNING"), (100.0, "SUCCEEDED")]
    one = AttemptTimes(1, 3.0, 5.0, 99.0, 90.0, recovery_s=2.0, rejoin_s=0.5)
    g = account(created=0.0, end=100.0, states=states, attempts=[one])
    assert g["lost_s"]["failure_detection"] == pytest.approx(2.0) and g["lost_s"]["restart"] == pytest.approx(0.5)
    assert g["productive_s"] + sum(g["lost_s"].values()) == pytest.approx(100.0)
    g["replicas"] = [
        {"replica": 0, "steps": 900, "productive_s": 90.0, "absent_s": 0.0, "losses": 0},
        {"replica": 1, "steps": 850, "productive_s": 85.0, "absent_s": 5.0, "losses": 2},
    ]
    line = goodput_line(RunGoodput.model_validate({"run_id": "r", "status": "SUCCEEDED", **g}))
    assert line.endswith("; per replica: r0 900 steps; r1 850 steps, out 5 s after 2 loss(es)"), line
