"""The trackers' queues (``service.runs.tracking``), without any tracker client: a tracker that is down gets the
run one event per outage and every item once it answers; a tracker that hangs never holds the caller; a full queue
drops the oldest metric rows, never the start or the final state. The sinks here are unit-test stand-ins for the
tracker; the real clients are exercised in test_mlflow.py, test_tensorboard.py and test_wandb.py."""

from __future__ import annotations

import threading

import pytest

from api.spec import RunSpec
from service.runs import tracking
from service.runs.tracking import Item, Rejected, Sink, Trackers, flatten, numeric_metrics


class FlakySink(Sink):
    name = "flaky"

    def __init__(self) -> None:
        self.up = threading.Event()
        self.got: list[Item] = []
        self.tries = 0

    def handle(self, item: Item) -> None:
        self.tries += 1
        if not self.up.is_set():
            raise ConnectionError("connection refused")
        if item.data.get("bad"):
            raise Rejected("a value the tracker refuses")
        self.got.append(item)


def rows(n: int, start: int = 1) -> list[dict]:
    return [{"step": s, "loss": 5.0 / s, "tokens_per_s": 100.0 * s, "breakdown": {"compute": 0.1}} for s in
            range(start, start + n)]


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(tracking, "RETRY_FIRST_S", 0.02)
    monkeypatch.setattr(tracking, "RETRY_MAX_S", 0.05)


def test_a_tracker_that_is_down_costs_one_event_and_catches_up():
    sink, events = FlakySink(), []
    hub = Trackers({"flaky": lambda: sink}, on_event=lambda k, r: events.append((k, r)))
    hub.start(RunSpec(), None, run_name="r")
    for i in range(10):
        hub.metrics(rows(3, start=1 + 3 * i))
    hub.event("straggler", "rank 1 is slow")
    tracking_wait(lambda: sink.tries >= 5)
    assert [k for k, _ in events] == ["tracker_unavailable"], events  # one event, however many retries
    assert "flaky" in events[0][1] and "ConnectionError" in events[0][1] and "goes on" in events[0][1]
    sink.up.set()
    hub.finish("SUCCEEDED", {"steps_done": 30})
    assert hub.close(30)
    kinds = [i.kind for i in sink.got]
    assert kinds[0] == "start" and kinds[-1] == "finish" and kinds.count("metrics") == 10 and "event" in kinds
    steps = [r["step"] for i in sink.got if i.kind == "metrics" for r in i.data["rows"]]
    assert steps == list(range(1, 31))  # every row, in order
    assert [k for k, _ in events] == ["tracker_unavailable"]


def test_a_second_outage_is_a_second_event_and_a_refused_item_is_dropped():
    sink, events = FlakySink(), []
    sink.up.set()
    hub = Trackers({"flaky": lambda: sink}, on_event=lambda k, r: events.append(k))
    hub.metrics(rows(1))
    tracking_wait(lambda: len(sink.got) == 1)
    sink.up.clear()
    hub.metrics(rows(1, start=2))
    tracking_wait(lambda: events == ["tracker_unavailable"])
    sink.up.set()
    tracking_wait(lambda: len(sink.got) == 2)
    sink.up.clear()
    hub.metrics(rows(1, start=3))
    tracking_wait(lambda: len(events) == 2)
    sink.up.set()
    hub._put("metrics", rows=rows(1, start=4), bad=True)
    hub.metrics(rows(1, start=5))
    assert hub.close(30)
    assert [i.data["rows"][0]["step"] for i in sink.got] == [1, 2, 3, 5]


def test_a_hanging_tracker_never_holds_the_caller_and_its_queue_is_bounded(monkeypatch):
    monkeypatch.setattr(tracking, "MAX_PENDING", 10)
    release = threading.Event()

    class Hanging(Sink):
        name = "hanging"

        def handle(self, item: Item) -> None:
            release.wait(60)

    hub = Trackers({"hanging": Hanging}, on_event=lambda k, r: None)
    hub.start(RunSpec(), None, run_name="r")
    for s in range(1, 501):  # returns although the tracker holds its first item
        hub.metrics(rows(1, start=s))
    lane = hub.lanes[0]
    assert len(lane.queue) <= 10 and lane.dropped >= 490
    assert lane.queue[-1].data["rows"][0]["step"] == 500  # the newest rows are kept
    assert hub.close(0.2) is False  # gives up at its bound; the run's driver exits anyway
    release.set()


def test_a_second_close_does_not_report_the_lost_items_again(caplog):
    class Down(Sink):
        name = "down"

        def handle(self, item: Item) -> None:
            raise ConnectionError("connection refused")

    hub = Trackers({"down": Down}, on_event=lambda k, r: None)
    hub.metrics(rows(3))
    with caplog.at_level("WARNING", logger=tracking.__name__):
        assert hub.close(0.2) is False
        assert hub.close(0.2) is False  # track_run's exit handler, after the caller's own close
    lost = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert lost == ["tracker down: 1 items not sent before the run's driver ended"]


def test_a_tracker_that_cannot_start_is_one_event_and_nothing_else():
    events = []

    def broken() -> Sink:
        raise ModuleNotFoundError("No module named 'wandb'")

    hub = Trackers({"wandb": broken}, on_event=lambda k, r: events.append((k, r)))
    hub.metrics(rows(5))
    assert hub.close(10)
    assert len(events) == 1 and events[0][0] == "tracker_unavailable" and "wandb" in events[0][1]


def test_rows_flatten_to_the_metrics_trackers_take():
    row = {"step": 3, "time": 1.0, "loss": 2.5, "mfu": 0.4, "peak_memory_bytes": 1024, "comm_share": 0.1,
           "breakdown": {"compute": 0.2, "dp_comm_exposed": 0.01}, "breakdown_per_rank": {"compute": [0.1, 0.2]},
           "lr": None, "nan": float("nan"), "ok": True}
    assert numeric_metrics(row) == {"loss": 2.5, "mfu": 0.4, "peak_memory_bytes": 1024.0, "comm_share": 0.1,
                                    "breakdown/compute": 0.2, "breakdown/dp_comm_exposed": 0.01}
    assert flatten({"spec": {"layout": {"dp": 2}, "labels": {}, "x": [1, 2]}}) == {"spec.layout.dp": 2,
                                                                                   "spec.x": "[1, 2]"}


def tracking_wait(check, timeout_s: float = 30.0) -> None:
    from tests.tracking.conftest import wait_until

    wait_until(check, timeout_s, "the tracker's thread")
