"""What every meshrun Ray Job's environment carries beyond credentials (tests/service/test_ownership.py has those)."""

from __future__ import annotations

from service.cluster.env import job_runtime_env
from service.settings import Settings


def _env(tmp_path) -> dict[str, str]:
    return job_runtime_env(Settings(data_dir=tmp_path), job_id="meshrun-x-1", gcs_address="127.0.0.1:6400")["env_vars"]


def test_train_polls_workers_every_half_second_by_default(tmp_path, monkeypatch):
    """Ray Train notices a failed worker only when it polls (Ray's default every 2 s): meshrun's jobs poll every
    0.5 s, which cuts failure detection per crash (bench/bench_goodput.py)."""
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert _env(tmp_path)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"


def test_the_service_environment_overrides_the_poll_interval(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0")
    assert _env(tmp_path)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2.0"
