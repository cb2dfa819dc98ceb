"""Names and places of a run's Ray Train run that the run driver needs without importing Ray Train (and torch): a
warm run's driver never does (``service.runs.warm_start``), and ``RunStart``, what both starters of a run's workers
take (the warm pool's ``fit_warm`` and Ray Train's ``build_trainer``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.spec import Plan, RunSpec
from service.cluster.placement import Placement
from service.settings import Settings

TORCH_TIMEOUT_S = int(os.environ.get("MESHRUN_TORCH_TIMEOUT_S", "120"))


def train_run_name(run_id: str, submission: int) -> str:
    """The Ray Train run name of a run's ``submission``-th Ray Job (unique: Train keeps state per name)."""
    return f"{run_id}-s{submission}"


def run_storage(spec: RunSpec, settings: Settings) -> str:
    """Where a run's checkpoints go: its ``checkpoint.storage`` or the service's root; a local directory (relative
    ones lie under data_dir, as the path policy reads them) is created."""
    storage = spec.checkpoint.storage or str(settings.checkpoint_root)
    if "://" not in storage:
        local = Path(storage).expanduser()
        storage = str(local if local.is_absolute() else Path(settings.data_dir) / local)
        Path(storage).mkdir(parents=True, exist_ok=True)
    return storage


@dataclass(frozen=True)
class RunStart:
    """One attempt's start of a run's workers, built once by its driver (a run's or a sweep trial's) and taken as it
    is by the warm pool (``service.runs.warm_start.fit_warm``) or by Ray Train (``service.runs.trainer.build_trainer``).
    ``placement`` is None for a sweep trial (the plan's worker resources place it)."""

    run_id: str
    run_name: str
    spec: RunSpec
    plan: Plan
    placement: Placement | None
    channel: Any  # the run channel's ActorHandle
    settings: Settings
    train_run_name: str
    resume_from: str | None = None
    attempt: int = 1  # the number a warm start registers (its channel's first); Ray Train's workers take the next

    @property
    def fitted(self) -> Placement | None:
        """The placement when it fits the cluster (its workers' resources, strategy and node pinning), else None."""
        return self.placement if self.placement is not None and self.placement.fits else None

    @property
    def storage(self) -> str:
        return run_storage(self.spec, self.settings)

    def resuming(self, path: str | None) -> RunStart:
        """The same start from checkpoint ``path`` (a restart after a failed attempt); None keeps ``resume_from``."""
        return self if path is None else dataclasses.replace(self, resume_from=path)
