"""Each tracker against its real client, fed through the entry the run driver uses (``open_trackers`` and the hub's
methods, as ``Recorder`` calls them), read back with the tracker's own reader: an ``mlflow server`` with a SQLite
backend through ``MlflowClient``, TensorBoard event files through ``EventAccumulator``, a W&B offline run from its
``.wandb`` file. The clients take seconds to import and the server minutes to start here: marked slow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from api.spec import RunSpec, TrackingSpec
from api.spec.validation import build_plan
from service.runs import tracking
from service.runs.tracking import open_trackers, tensorboard_dir
from tests.tracking.conftest import Forwarder, tensorboard_scalars, tensorboard_texts, wait_until

pytestmark = pytest.mark.slow

STEPS = 6
SPEC = RunSpec.model_validate({"name": "tracked", "layout": {"dp": 2}, "train": {"steps": STEPS},
                               "batch": {"global_batch_size": 4, "micro_batch_size": 2}})


def row(step: int) -> dict:
    return {"step": step, "time": time.time(), "loss": 6.0 - 0.5 * step, "tokens_per_s": 1000.0 + step,
            "mfu": 0.01 * step, "peak_memory_bytes": 1000 * step, "comm_share": 0.1,
            "breakdown": {"compute": 0.02 * step, "dp_comm_exposed": 0.001}}


def feed(hub, *, finish: str = "SUCCEEDED") -> None:
    """What a run's driver hands its trackers: start, the rows in two drains, events, a checkpoint, the end."""
    hub.start(SPEC, build_plan(SPEC), run_name="tracked")
    hub.metrics([row(s) for s in range(1, 4)])
    hub.event("straggler", "rank 1 is 2.0x slower than the median")
    hub.checkpoint(3, "/ckpt/run-x/step_3")
    hub.metrics([row(s) for s in range(4, STEPS + 1)])
    hub.finish(finish, {"steps_done": STEPS, "final_loss": 3.0, "mean_tokens_per_s": 1003.5, "reason": "done"})


def mlflow_run(url: str, experiment: str, meshrun_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment}"
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`meshrun.run_id` = '{meshrun_id}'")
    assert len(found) == 1, found
    return client, found[0]


def test_mlflow_gets_params_every_step_events_checkpoints_and_the_final_state(mlflow_server, tmp_path):
    events = []
    spec = TrackingSpec.model_validate({"mlflow": {"tracking_uri": mlflow_server, "experiment": "meshrun-test"}})
    hub = open_trackers(spec, run_id="run-mlflow1", data_dir=tmp_path, on_event=lambda k, r: events.append(k))
    feed(hub)
    assert hub.close(120)
    client, run = mlflow_run(mlflow_server, "meshrun-test", "run-mlflow1")
    assert events == []
    assert run.info.status == "FINISHED" and run.data.tags["meshrun.status"] == "SUCCEEDED"
    params = run.data.params
    assert params["spec.layout.dp"] == "2" and params["spec.train.steps"] == str(STEPS)
    assert params["plan.world_size"] == "2" and not any(k.startswith("spec.tracking") for k in params)
    for key in ("loss", "tokens_per_s", "mfu", "peak_memory_bytes", "comm_share", "breakdown/compute"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), key
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}[4] == pytest.approx(4.0)
    assert run.data.metrics["summary/final_loss"] == 3.0
    tags = run.data.tags
    assert tags["meshrun.checkpoint.latest"] == "/ckpt/run-x/step_3" and "meshrun.checkpoint.step_3" in tags
    assert any(v.startswith("straggler: rank 1") for k, v in tags.items() if k.startswith("meshrun.event."))


def test_a_sweep_is_a_parent_run_with_its_trials_as_children(mlflow_server, tmp_path):
    spec = TrackingSpec.model_validate({"mlflow": {"tracking_uri": mlflow_server, "experiment": "meshrun-sweep"}})
    for trial, status in (("run-trial1", "SUCCEEDED"), ("run-trial2", "CANCELLED")):
        hub = open_trackers(spec, run_id=trial, data_dir=tmp_path, on_event=lambda k, r: None, parent="swp-1")
        feed(hub, finish=status)
        assert hub.close(120)
    _, parent = mlflow_run(mlflow_server, "meshrun-sweep", "swp-1")
    _, one = mlflow_run(mlflow_server, "meshrun-sweep", "run-trial1")
    _, two = mlflow_run(mlflow_server, "meshrun-sweep", "run-trial2")
    assert one.data.tags["mlflow.parentRunId"] == two.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert (one.info.status, two.info.status) == ("FINISHED", "KILLED")


def test_an_mlflow_server_that_is_down_costs_one_event_and_gets_everything_when_it_returns(
    mlflow_server, tmp_path, monkeypatch
):
    monkeypatch.setattr(tracking, "RETRY_MAX_S", 1.0)
    proxy = Forwarder(int(mlflow_server.rsplit(":", 1)[1]))  # refuses connections until started
    events = []
    spec = TrackingSpec.model_validate({"mlflow": {"tracking_uri": proxy.url, "experiment": "meshrun-down"}})
    hub = open_trackers(spec, run_id="run-down1", data_dir=tmp_path, on_event=lambda k, r: events.append((k, r)))
    try:
        feed(hub)  # the whole run happens while the tracker is down: every call returns at once
        wait_until(lambda: events, 60, "the tracker_unavailable event")
        proxy.start()
        assert hub.close(180)
    finally:
        proxy.stop()
    assert [k for k, _ in events] == ["tracker_unavailable"] and "mlflow" in events[0][1]
    client, run = mlflow_run(mlflow_server, "meshrun-down", "run-down1")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, STEPS + 1))


def test_tensorboard_event_files_hold_every_step_and_the_run_s_story(tmp_path):
    hub = open_trackers(TrackingSpec(tensorboard=True), run_id="run-tb1", data_dir=tmp_path,
                        on_event=lambda k, r: None)
    feed(hub)
    assert hub.close(120)
    logdir = tensorboard_dir(tmp_path, "run-tb1")
    assert logdir == Path(tmp_path) / "tracking" / "run-tb1" / "tensorboard"
    scalars = tensorboard_scalars(logdir)
    for key in ("loss", "tokens_per_s", "mfu", "peak_memory_bytes", "comm_share", "breakdown/compute"):
        assert [s for s, _ in scalars[key]] == list(range(1, STEPS + 1)), key
    assert dict(scalars["loss"])[2] == pytest.approx(5.0) and scalars["summary/final_loss"] == [(0, 3.0)]
    texts = tensorboard_texts(logdir)
    assert texts["meshrun/status/text_summary"] == ["SUCCEEDED"]
    assert any("straggler: rank 1" in t for t in texts["meshrun/events/text_summary"])
    assert any("/ckpt/run-x/step_3" in t for t in texts["meshrun/checkpoints/text_summary"])
    assert any("spec.layout.dp = 2" in t for t in texts["meshrun/params/text_summary"])


def test_a_wandb_offline_run_is_written_to_the_run_s_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = TrackingSpec.model_validate({"wandb": {"project": "meshrun-test", "mode": "offline"}})
    events = []
    hub = open_trackers(spec, run_id="run-wb1", data_dir=tmp_path, on_event=lambda k, r: events.append((k, r)))
    feed(hub)
    assert hub.close(240)
    assert events == []
    files = list((tmp_path / "tracking" / "run-wb1").rglob("run-*.wandb"))
    assert len(files) == 1, list((tmp_path / "tracking").rglob("*"))
    # wandb's service process writes the file; its exit record is last
    wait_until(lambda: any(r.WhichOneof("record_type") == "exit" for r in wandb_records(files[0])), 60, "exit")
    records = wandb_records(files[0])
    history = [r for r in records if r.WhichOneof("record_type") == "history"]
    steps = {}
    for h in history:
        items = {i.key or "/".join(i.nested_key): i.value_json for i in h.history.item}
        if "loss" in items:
            steps[int(items["_step"])] = float(items["loss"])
    assert sorted(steps) == list(range(1, STEPS + 1)) and steps[2] == pytest.approx(5.0)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")  # the config comes with the run
    config = {i.key: i.value_json for i in run.config.update}
    assert config["spec.layout.dp"] == "2" and config["plan.world_size"] == "2"
    summary = {i.key or "/".join(i.nested_key): i.value_json for r in records
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert summary.get("meshrun/status") == '"SUCCEEDED"'
    assert summary.get("meshrun/checkpoint/latest") == '"/ckpt/run-x/step_3"'
    exits = [r for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[-1].exit.exit_code == 0


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` transaction log, parsed with wandb's own protobuf ``Record`` (wandb 0.31 ships no
    Python reader of the file). The format: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    records, each ``crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last) | data``. A record cut
    short by the end of the file is one still being written: the records before it are returned."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if pos + 7 + length > len(raw):
            break  # a record wandb's service is still appending (the test reads the file while it is written)
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out
