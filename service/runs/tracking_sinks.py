"""The three trackers behind ``service.runs.tracking``: MLflow (``MlflowClient`` against the tracking server),
TensorBoard (event files through ``torch.utils.tensorboard``) and W&B (``wandb.init`` in online or offline mode).
Each client is imported when its sink is made, so the service runs without the tracking extra."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from api.spec import TrackingSpec
from service.runs.tracking_base import Item, Rejected, Sink, numeric_metrics, tensorboard_dir, tracking_dir

MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
MLFLOW_PARAMS_BATCH = 100
RUN_ID_TAG = "meshrun.run_id"
TERMINAL = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def _key(k: str) -> str:
    return _BAD_KEY.sub("_", k)[:250]


def _stamp(row: dict[str, Any]) -> int:
    t = row.get("time")
    return int((t if isinstance(t, int | float) else time.time()) * 1000)


# ------------------------------------------------------------------------------------------------ mlflow
class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, *, run_id: str, parent: str | None):
        # our lanes retry with backoff; the client's own retries (minutes) would hold a lane on one request
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.experiment, self.run_id, self.parent = experiment, run_id, parent
        self.mlflow_run: str | None = None
        self.events = 0

    def _find(self, experiment_id: str, meshrun_id: str) -> str | None:
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{meshrun_id}'", max_results=1
        )
        return found[0].info.run_id if found else None

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        return exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)

    def _open(self, run_name: str) -> str:
        """The MLflow run of this meshrun run (found again by its tag after a driver restart), under the sweep's
        parent run for a trial."""
        if self.mlflow_run is None:
            exp = self._experiment_id()
            tags = {RUN_ID_TAG: self.run_id}
            if self.parent:
                parent = (
                    self._find(exp, self.parent)
                    or self.client.create_run(
                        exp, run_name=self.parent, tags={RUN_ID_TAG: self.parent, "meshrun.kind": "sweep"}
                    ).info.run_id
                )
                tags["mlflow.parentRunId"] = parent
                tags["meshrun.sweep_id"] = self.parent
            self.mlflow_run = (
                self._find(exp, self.run_id) or self.client.create_run(exp, run_name=run_name, tags=tags).info.run_id
            )
        return self.mlflow_run

    def handle(self, item: Item) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        d = item.data
        try:
            run = self._open(d.get("run_name") or self.run_id)
            if item.kind == "start":
                params = [Param(_key(k), str(v)[:6000]) for k, v in sorted(d["params"].items())]
                for i in range(0, len(params), MLFLOW_PARAMS_BATCH):
                    self.client.log_batch(run, params=params[i : i + MLFLOW_PARAMS_BATCH])
                self.client.set_tag(run, "meshrun.status", "RUNNING")
            elif item.kind == "metrics":
                metrics = [
                    Metric(_key(k), v, _stamp(r), int(r["step"]))
                    for r in d["rows"]
                    for k, v in numeric_metrics(r).items()
                ]
                for i in range(0, len(metrics), MLFLOW_BATCH):
                    self.client.log_batch(run, metrics=metrics[i : i + MLFLOW_BATCH])
            elif item.kind == "event":
                self.events += 1
                tags = [
                    RunTag(f"meshrun.event.{self.events:05d}", f"{d['kind']}: {d['reason']}"[:8000]),
                    RunTag(f"meshrun.last.{_key(d['kind'])}", str(d["reason"])[:8000]),
                ]
                self.client.log_batch(run, tags=tags)
            elif item.kind == "checkpoint":
                self.client.log_batch(
                    run,
                    tags=[
                        RunTag(f"meshrun.checkpoint.step_{d['step']}", d["path"]),
                        RunTag("meshrun.checkpoint.latest", d["path"]),
                    ],
                )
            elif item.kind == "finish":
                summary = {f"summary/{k}": v for k, v in numeric_metrics(d["summary"]).items()}
                now = int(time.time() * 1000)
                self.client.log_batch(
                    run,
                    metrics=[Metric(_key(k), v, now, 0) for k, v in summary.items()],
                    tags=[
                        RunTag("meshrun.status", d["status"]),
                        RunTag("meshrun.summary", json.dumps(d["summary"], default=str)[:8000]),
                    ],
                )
                self.client.set_terminated(run, status=TERMINAL.get(d["status"], "FAILED"))
        except MlflowException as e:
            code = str(getattr(e, "error_code", ""))
            if code in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE"):
                raise Rejected(str(e)[:300]) from e
            raise


# ------------------------------------------------------------------------------------------- tensorboard
class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=5)
        self.events = 0

    def handle(self, item: Item) -> None:
        d, w = item.data, self.writer
        if item.kind == "start":
            w.add_text("meshrun/params", "\n".join(f"    {k} = {v}" for k, v in sorted(d["params"].items())), 0)
        elif item.kind == "metrics":
            for r in d["rows"]:
                for k, v in numeric_metrics(r).items():
                    w.add_scalar(k, v, int(r["step"]), walltime=r.get("time"))
        elif item.kind == "event":
            self.events += 1
            w.add_text("meshrun/events", f"{d['kind']}: {d['reason']}", self.events)
        elif item.kind == "checkpoint":
            w.add_text("meshrun/checkpoints", f"step {d['step']}: {d['path']}", d["step"])
        elif item.kind == "finish":
            for k, v in numeric_metrics(d["summary"]).items():
                w.add_scalar(f"summary/{k}", v, 0)
            w.add_text("meshrun/status", d["status"], 0)
        w.flush()

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------------------------------------- wandb
class WandbSink(Sink):
    name = "wandb"

    def __init__(self, cfg: dict[str, Any], *, run_id: str, data_dir: str | Path, parent: str | None):
        import wandb

        self.wandb = wandb
        self.cfg, self.run_id, self.parent = cfg, run_id, parent
        self.dir = tracking_dir(data_dir, run_id)
        self.run: Any = None

    def _open(self, run_name: str, config: dict[str, Any] | None) -> Any:
        if self.run is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.run = self.wandb.init(
                project=self.cfg.get("project") or "meshrun",
                entity=self.cfg.get("entity"),
                mode=self.cfg.get("mode") or "online",
                dir=str(self.dir),
                id=re.sub(r"[^A-Za-z0-9_-]", "-", self.run_id),
                name=run_name,
                group=self.parent,
                job_type="trial" if self.parent else "run",
                config=config,
                resume="allow",
                reinit="create_new",
                settings=self.wandb.Settings(init_timeout=60, silent=True, console="off"),
            )
        return self.run

    def handle(self, item: Item) -> None:
        d = item.data
        run = self._open(d.get("run_name") or self.run_id, d.get("params") if item.kind == "start" else None)
        if item.kind == "metrics":
            for r in d["rows"]:
                run.log(numeric_metrics(r), step=int(r["step"]))
        elif item.kind == "event":
            run.summary[f"meshrun/event/{d['kind']}"] = d["reason"]
        elif item.kind == "checkpoint":
            run.summary["meshrun/checkpoint/latest"] = d["path"]
            run.summary[f"meshrun/checkpoint/step_{d['step']}"] = d["path"]
        elif item.kind == "finish":
            for k, v in d["summary"].items():
                run.summary[f"summary/{k}"] = v
            run.summary["meshrun/status"] = d["status"]
            run.finish(exit_code=0 if d["status"] == "SUCCEEDED" else 1)
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


def make_sink(
    name: str,
    tracking: TrackingSpec,
    *,
    run_id: str,
    data_dir: str | Path,
    parent: str | None = None,
    project: str | None = None,
) -> Sink:
    if name == "mlflow":
        assert tracking.mlflow is not None
        uri = tracking.mlflow.tracking_uri or str(tracking_dir(data_dir, "mlruns"))
        return MlflowSink(uri, tracking.mlflow.experiment or "meshrun", run_id=run_id, parent=parent)
    if name == "tensorboard":
        return TensorBoardSink(tensorboard_dir(data_dir, run_id))
    if name == "wandb":
        assert tracking.wandb is not None
        return WandbSink(tracking.wandb.model_dump(), run_id=run_id, data_dir=data_dir, parent=parent)
    raise ValueError(f"unknown tracker {name!r}")
