"""Fixtures for sweep tests: specs of a tiny GPT, a planning cluster, a fake runtime, an API client on SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.spec import ClusterSpec
from service.cluster.placement import never_fits as placement_never_fits
from service.cluster.jobs import JobState


def tiny_base(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "sw",
        "model": {"name": "gpt", "preset": "tiny"},
        "data": {"source": "synthetic"},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "train": {"steps": 50, "seed": 0},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }
    base.update(over)
    return base


def cpu_cluster(cpus: int = 6, *, memory_bytes: int = 2 << 30) -> ClusterSpec:
    return ClusterSpec(device="cpu", gpus_per_node=cpus, nodes=1, peak_flops_per_s=20e9, memory_bytes=memory_bytes)


@dataclass
class FakeJobs:
    submitted: list[dict[str, Any]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)

    def submit(self, **kw: Any) -> str:
        self.submitted.append(kw)
        self.states[kw["submission_id"]] = "RUNNING"
        return kw["submission_id"]

    def state(self, job_id: str) -> JobState:
        return JobState(status=self.states.get(job_id, "MISSING"), message=None)

    def stop(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        self.states[job_id] = "STOPPED"
        return True

    def reset(self) -> None:
        pass


class FakeRuntime:
    """What the sweep routes use of ``service.control.runtime.Runtime`` (``service.sweeps.SweepHost``): the planning
    cluster, the capacity check, the Jobs client and the cluster's addresses."""

    def __init__(self, factory: Any, settings: Any, cluster: ClusterSpec | None = None, cpus: float = 6):
        self.factory, self.settings = factory, settings
        self.jobs = FakeJobs()
        self.scheduler = None
        self.dashboard_url = "http://127.0.0.1:8265"
        self.gcs_address = "127.0.0.1:6389"
        self._cluster = cluster or cpu_cluster(int(cpus))
        self._cpus = cpus

    def stop(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def planning_cluster(self) -> ClusterSpec | None:
        return self._cluster

    def never_fits(self, plan: Any, *, reserved_cpu: float = 0.0) -> str | None:
        from service.cluster.placement import NodeCapacity

        return placement_never_fits(plan, [NodeCapacity("n1", {"CPU": self._cpus}, {"CPU": self._cpus})],
                                    reserved_cpu=reserved_cpu)


@pytest.fixture
def api(tmp_path) -> Iterator[TestClient]:
    from service.app.server import create_app
    from service.settings import Settings

    app = create_app(Settings(start_scheduler=False, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/m.db",
                              rate_limit_per_minute=0))
    with TestClient(app) as client:
        yield client


@pytest.fixture
def fake_runtime(api: TestClient) -> FakeRuntime:
    app = api.app
    rt = FakeRuntime(app.state.session_factory, app.state.settings)
    app.state.runtime = rt
    return rt
