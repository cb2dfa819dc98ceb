"""``checkpoint.memory_copy``: an in-memory copy of the newest checkpoint outside the worker group.

A Ray Train restart after a failure ends every worker of the group, so a copy of a checkpoint that must survive it
lives elsewhere: in the run's channel actor (``service.cluster.jobs.RunChannel``), which the run's driver owns on its
node for the whole run (every attempt). After each checkpoint every rank sends the files it wrote (its DCP shard;
rank 0 also the metadata and meshrun's manifest) with ``keep``; the channel keeps the newest step whose copy is
complete (every rank's files). When the next attempt starts from Ray Train's latest checkpoint, ``restore`` writes
that step's files from memory into a local directory, every rank all of them (DCP reads whichever files hold the
tensors a rank needs), and the attempt resumes from there; an incomplete copy (a rank died before sending its own)
or a failed fetch falls back to storage. Imports ray only (no torch).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import ray

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 120.0
STEP_RE = re.compile(r"step_(\d{8})(?:_a\d+)?$")


def files_of(path: str | Path) -> dict[str, bytes]:
    """Every file under ``path`` by its relative name."""
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def keep(channel: Any, step: int, rank: int, world: int, path: str | Path) -> None:
    """Send this rank's files of the checkpoint of ``step`` (in ``path``, before Ray Train moves them) to the
    channel; fire and forget: a copy that never arrives only makes a restart read storage."""
    try:
        channel.keep_copy.remote(int(step), int(rank), int(world), files_of(path))
    except Exception as e:  # the copy is an optimisation: the checkpoint itself goes to storage anyway
        logger.warning("rank %d: no in-memory copy of the checkpoint of step %d: %s", rank, step, e)


def step_of(checkpoint_path: str) -> int | None:
    """The step of a checkpoint directory Ray Train reports (``step_XXXXXXXX_aN``)."""
    hit = STEP_RE.search(str(checkpoint_path).rstrip("/"))
    return int(hit.group(1)) if hit else None


def restore(channel: Any, step: int, into: str | Path) -> tuple[Path, int] | None:
    """The complete in-memory copy of the checkpoint of ``step`` written into ``into``: (the directory, its bytes),
    or None (no complete copy, or the fetch failed: the caller reads storage)."""
    try:
        copies = ray.get(channel.copy_of.remote(int(step)), timeout=FETCH_TIMEOUT_S)
    except Exception as e:
        logger.warning("the in-memory copy of step %d could not be fetched (%s): reading storage", step, e)
        return None
    if not copies:
        return None
    out = Path(into)
    shutil.rmtree(out, ignore_errors=True)
    size = 0
    for files in copies.values():
        for name, data in files.items():
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            size += len(data)
    return out, size
