"""Acting on a hang the run driver detected (``service.runs.watch.HangWatch``): dump every rank's Python stack
(``workers.diagnostics.dump_stacks``: py-spy, else the faulthandler signal and the rank's stacks file), then end
the attempt by killing the ranks' processes, so that Ray Train's recovery (``max_failures``, the latest
checkpoint) takes over. Both run as small Ray tasks pinned to each rank's node (the ranks may be on other hosts).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from workers.diagnostics import describe_hang, dump_stacks

logger = logging.getLogger(__name__)
TASK_TIMEOUT_S = 60.0


def state_dir(data_dir: str | os.PathLike[str], run_id: str, attempt: int) -> Path:
    """Where the workers keep their state and stack files (``workers.ray_worker``: under the job's
    ``local_checkpoint_root``, which ``service.runs.trainer`` sets to ``<data_dir>/tmp``)."""
    return Path(data_dir) / "tmp" / "meshrun-state" / run_id / f"a{attempt}"


def _dump(pid: int, stacks_file: str | None) -> str:
    text = dump_stacks(pid)
    if text.startswith("(sent") and stacks_file:  # the signal path: faulthandler appends to the rank's file
        for _ in range(20):
            time.sleep(0.25)
            p = Path(stacks_file)
            if p.exists() and p.stat().st_size:
                return p.read_text()[-200_000:]
    return text


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


_dump_task = ray.remote(num_cpus=0, max_retries=0)(_dump)
_kill_task = ray.remote(num_cpus=0, max_retries=0)(_kill)


def _on(node_id: str | None) -> dict[str, Any]:
    if not node_id:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


def diagnose(states: list[dict[str, Any]], *, world_size: int | None, timeout_s: float) -> str:
    """The one-line reason of a hang, e.g. "hang: no step for 31 s (timeout 30 s): rank 1 stuck in compute at
    step 5 ...; rank 0 waiting in all_reduce (dp_replicate)"."""
    return f"hang: no step completed for over {timeout_s:.0f} s: {describe_hang(states, world_size=world_size)}"


def dump_and_kill(ranks: list[dict[str, Any]], *, stacks_dir: Path | None) -> dict[int, str]:
    """Every rank's stacks (rank -> text), then SIGKILL every rank's process. Failures are logged, never raised."""
    dumps: dict[int, str] = {}
    refs = {}
    for r in ranks:
        f = str(stacks_dir / f"rank{r['rank']}.stacks.txt") if stacks_dir else None
        refs[int(r["rank"])] = _dump_task.options(**_on(r.get("node_id"))).remote(int(r["pid"]), f)
    for rank, ref in refs.items():
        try:
            dumps[rank] = ray.get(ref, timeout=TASK_TIMEOUT_S)
        except Exception as e:
            dumps[rank] = f"(stack dump failed: {type(e).__name__}: {e})"
    kills = [_kill_task.options(**_on(r.get("node_id"))).remote(int(r["pid"])) for r in ranks]
    for kill in kills:
        try:
            ray.get(kill, timeout=TASK_TIMEOUT_S)
        except Exception:
            logger.exception("killing a hung rank failed")
    return dumps
