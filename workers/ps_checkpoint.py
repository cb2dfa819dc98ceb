"""Checkpoints of the parameter servers of ``layout.sync: async_ps`` (``workers.ps``), for in-run recovery.

Every ``checkpoint.every_steps`` updates each server writes its shard's state (fp32 parameters, optimizer and LR
schedule state, the update counter) to ``<root>/step-<N>/shard-<k>.pt``: written to a temporary name, flushed to
disk, then renamed into place (as ``workers.checkpoint_manifest.write_json_atomic``), so a file is either whole
or absent. All servers apply the same sequence of updates, so their step-``N`` files are one consistent state;
step ``N`` is complete when every shard's file is there (``complete_steps``). After its save a server removes
the steps older than the ``keep`` latest complete ones, so a step a slower server has not written yet never
costs the last complete one.

These are not the run's DCP checkpoints (``workers.checkpoint``): they are not listed for ``resume_from``; the
supervisor (``workers.async_ps``) reads them when a server is lost and restarts every server from the latest
complete step.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def shard_file(root: str | os.PathLike, step: int, shard: int) -> Path:
    return Path(root) / f"step-{step:08d}" / f"shard-{shard}.pt"


def save_shard(root: str | os.PathLike, step: int, shard: int, state: dict[str, Any]) -> Path:
    """Write one shard's state for update ``step`` atomically."""
    path = shard_file(root, step, shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, "step": step, "shard": shard, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def complete_steps(root: str | os.PathLike, shards: int) -> list[int]:
    """Steps whose every shard file is written, ascending."""
    out: list[int] = []
    d = Path(root)
    if not d.is_dir():
        return out
    for child in d.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and all((child / f"shard-{k}.pt").is_file() for k in range(shards)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_complete(root: str | os.PathLike | None, shards: int) -> int:
    """The latest complete step (0: none, the initial parameters)."""
    steps = complete_steps(root, shards) if root else []
    return steps[-1] if steps else 0


def load_shard(root: str | os.PathLike, step: int, shard: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(shard_file(root, step, shard), map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT or state.get("step") != step or state.get("shard") != shard:
        raise ValueError(f"{shard_file(root, step, shard)} is not shard {shard} of step {step}")
    return state


def prune(root: str | os.PathLike, shards: int, keep: int) -> None:
    """Remove the steps older than the ``keep`` latest complete ones (any server may: they are never read again)."""
    complete = complete_steps(root, shards)
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for child in Path(root).iterdir():
        m = _STEP_DIR.match(child.name)
        if m and int(m.group(1)) < oldest_kept:
            shutil.rmtree(child, ignore_errors=True)  # another server may be removing it too
