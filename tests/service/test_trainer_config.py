"""service.runs.trainer: a worker group that cannot start is not retried forever (Ray Train's default): a sweep trial
fails at its first start timeout, a run after RUN_START_RETRIES more. Builds the trainer only (no Ray cluster)."""

from __future__ import annotations

from api.spec import RunSpec
from api.spec.validation import build_plan
from service.runs.trainer import RUN_START_RETRIES, build_trainer, placing_phase
from service.settings import Settings


def test_worker_group_start_failures_are_bounded(tmp_path):
    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
                                   "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                                   "resources": {"device": "cpu"}})
    plan = build_plan(spec)
    limits = {}
    for stoppable in (True, False):
        trainer = build_trainer(run_id="r", run_name="n", resume_from=None, spec=spec, plan=plan, placement=None,
                                channel=None, settings=Settings(data_dir=tmp_path), train_run_name=f"x{stoppable}",
                                stoppable=stoppable)
        limits[stoppable] = trainer.run_config.failure_config.controller_failure_limit
    assert limits == {True: 0, False: RUN_START_RETRIES} and RUN_START_RETRIES >= 0
    assert placing_phase(plan).startswith("placing 2 workers of 1 CPU")


def test_no_ray_datasets_callback_without_ray_datasets(tmp_path):
    """Ray Train's datasets callback would start a DatasetManager actor (a process) at every worker group start."""
    from ray.train.v2._internal.callbacks import BackendSetupCallback, DatasetsCallback

    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
                                   "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                                   "resources": {"device": "cpu"}})
    trainer = build_trainer(run_id="r", run_name="n", resume_from=None, spec=spec, plan=build_plan(spec),
                            placement=None, channel=None, settings=Settings(data_dir=tmp_path), train_run_name="x")
    callbacks = trainer._create_default_callbacks()
    assert not any(isinstance(c, DatasetsCallback) for c in callbacks)
    assert any(isinstance(c, BackendSetupCallback) for c in callbacks)  # the rest are Ray Train's own
