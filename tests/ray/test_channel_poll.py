"""The run channel as the workers use it, on the session's Ray cluster: rank 0's control poll never waits in the step
loop (``workers.ray_worker.ControlPoll``), and a warm job registers its attempt under its driver's number without
waiting for the channel (``RunChannel.begin_attempt``)."""

from __future__ import annotations

import time

import pytest
import ray

from service.cluster.jobs import RunChannel, RunChannelActor
from workers.ray_worker import ControlPoll


def _until(poll: ControlPoll, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = poll()
        if got is not None and pred(got):
            return got
        time.sleep(0.05)
    raise AssertionError("the poll never answered as expected")


def test_a_control_poll_answers_one_report_later_and_never_blocks(ray_session):
    channel = RunChannelActor.remote("run-poll", 1)
    poll = ControlPoll(channel)
    t0 = time.perf_counter()
    assert poll() is None  # the first call sends a poll: nothing to answer yet, and no wait for the new actor
    assert time.perf_counter() - t0 < 2.0  # an actor start takes about 1 s here: the call did not wait for it
    assert _until(poll, lambda c: True) == {"stop": False, "preempt": None, "profile_steps": 0}
    ray.get(channel.request_profile.remote(3))
    got = _until(poll, lambda c: c["profile_steps"] > 0)
    assert got["profile_steps"] == 3 and got["stop"] is False  # handed out once
    ray.get(channel.request_stop.remote())
    assert _until(poll, lambda c: c["stop"])["stop"] is True
    ray.kill(channel)


@pytest.mark.parametrize("stop_if_gone", [True, False])
def test_a_dead_channel_stops_a_warm_job_only(ray_session, stop_if_gone):
    channel = RunChannelActor.remote(f"run-gone-{stop_if_gone}", 1)
    poll = ControlPoll(channel, stop_if_gone=stop_if_gone)
    _until(poll, lambda c: True)  # up and answering
    ray.kill(channel)
    deadline = time.monotonic() + 30
    answers = []
    while time.monotonic() < deadline and len(answers) < 5:
        answers.append(poll())
        time.sleep(0.1)
    if stop_if_gone:
        assert {"stop": True} in answers  # a warm worker's orphaned job stops
    else:
        assert all(a is None or not a.get("stop") for a in answers)  # a Ray Train worker keeps training


def test_an_attempt_named_by_its_driver():
    ch = RunChannel("run-x", first_attempt=3)
    assert ch.begin_attempt({"ranks": [], "attempt": 3}) == 3  # a warm job: its driver's number
    assert ch.begin_attempt({"ranks": []}) == 4  # then Ray Train's restart: the next one
    assert [e["attempt"] for e in ch.drain() if e["type"] == "attempt"] == [3, 4]
