"""service.runs.trainer: a worker group that cannot start is not retried forever (Ray Train's default): a sweep trial
fails at its first start timeout, a run after RUN_START_RETRIES more. Builds the trainer only (no Ray cluster)."""

from __future__ import annotations

from api.spec import RunSpec
from api.spec.validation import build_plan
from service.runs.naming import RunStart
from service.runs.trainer import RUN_START_RETRIES, build_trainer, placing_phase
from service.settings import Settings


def test_worker_group_start_failures_are_bounded(tmp_path):
    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
                                   "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                                   "resources": {"device": "cpu"}})
    plan = build_plan(spec)
    limits = {}
    for stoppable in (True, False):
        start = RunStart("r", "n", spec, plan, None, None, Settings(data_dir=tmp_path), f"x{stoppable}")
        trainer = build_trainer(start, stoppable=stoppable)
        limits[stoppable] = trainer.run_config.failure_config.controller_failure_limit
    assert limits == {True: 0, False: RUN_START_RETRIES} and RUN_START_RETRIES >= 0
    assert placing_phase(plan).startswith("placing 2 workers of 1 CPU")


def test_no_ray_datasets_callback_without_ray_datasets(tmp_path):
    """Ray Train's datasets callback would start a DatasetManager actor (a process) at every worker group start."""
    from ray.train.v2._internal.callbacks import BackendSetupCallback, DatasetsCallback

    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
                                   "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                                   "resources": {"device": "cpu"}})
    start = RunStart("r", "n", spec, build_plan(spec), None, None, Settings(data_dir=tmp_path), "x")
    trainer = build_trainer(start)
    callbacks = trainer._create_default_callbacks()
    assert not any(isinstance(c, DatasetsCallback) for c in callbacks)
    assert any(isinstance(c, BackendSetupCallback) for c in callbacks)  # the rest are Ray Train's own


def test_one_run_start_for_both_starters(tmp_path):
    """The driver builds one RunStart; a restart after a failed warm attempt is the same start from the latest
    checkpoint with the failures left, and Ray Train gets exactly that."""
    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
                                   "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                                   "resources": {"device": "cpu", "max_failures": 3},
                                   "checkpoint": {"storage": str(tmp_path / "ck")}})
    start = RunStart("r", "n", spec, build_plan(spec), None, None, Settings(data_dir=tmp_path), "r-s1", "/old")
    assert start.resuming(None) is start
    again = start.resuming("/ck/step_8")
    assert (again.resume_from, start.resume_from, again.run_id, again.plan) == ("/ck/step_8", "/old", "r", start.plan)
    assert start.storage == str(tmp_path / "ck") and (tmp_path / "ck").is_dir()
    assert start.fitted is None  # no placement (a sweep trial): the plan's worker resources place it
    trainer = build_trainer(again, max_failures=2)
    assert trainer.run_config.failure_config.max_failures == 2
    assert trainer.train_loop_config["resume_from"] == "/ck/step_8"
    assert trainer.run_config.storage_path == str(tmp_path / "ck") and trainer.run_config.name == "r-s1"
    assert build_trainer(start).run_config.failure_config.max_failures == 3  # the spec's when not overridden
