"""What the sweeps need from the service's runtime (``service.control.runtime.Runtime`` is one): the sweeps sit
below the control layer, so they name its parts in a Protocol instead of importing it."""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from api.spec import ClusterSpec, Plan
from service.cluster.jobs import JobsBackend
from service.settings import Settings


class SweepHost(Protocol):
    settings: Settings
    factory: sessionmaker[Session]

    @property
    def jobs(self) -> JobsBackend | None:
        """The Ray Jobs client (None before the runtime started)."""

    @property
    def gcs_address(self) -> str | None:
        """The Ray cluster's GCS address (host:port) the sweep's job connects to."""

    @property
    def dashboard_url(self) -> str | None: ...

    def planning_cluster(self) -> ClusterSpec | None:
        """The live cluster as the planner sees it (None when unknown)."""

    def never_fits(self, plan: Plan | dict[str, Any], *, reserved_cpu: float = 0.0) -> str | None:
        """Why ``plan`` can never be placed on the cluster beside ``reserved_cpu`` held by its sweep, or None."""
