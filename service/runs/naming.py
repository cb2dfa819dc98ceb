"""Names and places of a run's Ray Train run that the run driver needs without importing Ray Train (and torch): a
warm run's driver never does (``service.runs.warm_start``)."""

from __future__ import annotations

import os
from pathlib import Path

from api.spec import RunSpec
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
