"""Hang diagnosis and fault injection on the worker side.

"Where am I" (``RankState``): every rank keeps a small record that the training thread updates at almost no cost
(attribute writes): the step, the phase (``setup``, ``data``, ``compute``, ``optimizer``, ``report``,
``checkpoint``, ``done``), the collective it is in (name, process-group label such as ``dp_shard`` or ``tp``, and
since when), the pipeline stage / micro-batch / action (F, B, W) it last ran, and an injected fault if any.

Readable from outside, by two means (``Heartbeat``, a daemon thread, every ``MESHRUN_HEARTBEAT_S`` seconds,
default 2; it runs while the training thread is blocked in C++ because collectives release the GIL):

- a JSON file ``<state_dir>/rank<r>.json`` (written atomically) when the job has a ``state_dir``;
- a callback ``on_state(snapshot)`` (the Ray worker forwards it to the run's channel actor if that offers a
  ``rank_state`` method).

A snapshot is ``RankState.snapshot()``: ``rank, world_size, pid, host, run_id, attempt, step, steps_done, phase,
phase_since, collective, group, collective_since, pp_stage, pp_microbatch, pp_action, fault, last_step_end,
heartbeat`` (times are unix seconds). ``describe_hang(snapshots)`` turns the snapshots of all ranks into one line
such as ``"rank 1 stuck in compute at step 812 for 95 s; rank 0 waiting in all_reduce (dp_replicate) at step
812"``.

Python stacks: ``install_stack_dump`` registers ``faulthandler`` for ``SIGUSR1`` (``MESHRUN_STACK_SIGNAL``): ``kill
-USR1 <pid>`` appends every thread's stack to ``<state_dir>/rank<r>.stacks.txt`` (stderr without a state dir).
``dump_stacks(pid)`` does it from outside with ``py-spy dump`` when py-spy is installed, else with the signal.

Faults (``spec.faults``; ``FaultInjector``): ``slow_rank`` sleeps ``delay_s`` inside the compute phase of every step
(so it shows as compute, like a slow GPU); ``hang_rank`` blocks forever inside the compute phase of ``at_step``
(state ``fault: hang_rank``); ``kill_rank`` SIGKILLs the process at the start of ``at_step``. Hang and kill fire in
attempt 1 only, so a run that recovers from a checkpoint can finish.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEARTBEAT_S = float(os.environ.get("MESHRUN_HEARTBEAT_S", "2"))


class RankState:
    """This rank's "where am I" record (see the module docstring)."""

    def __init__(self, *, rank: int, world_size: int, run_id: str = "local", attempt: int = 1) -> None:
        self.rank, self.world_size, self.run_id, self.attempt = rank, world_size, run_id, attempt
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.step = 0
        self.steps_done = 0
        self.phase = "setup"
        self.phase_since = time.time()
        self.collective: str | None = None
        self.group: str | None = None
        self.collective_since: float | None = None
        self.pp_stage: int | None = None
        self.pp_microbatch: int | None = None
        self.pp_action: str | None = None
        self.fault: str | None = None
        self.last_step_end: float | None = None

    def set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    def set_collective(self, name: str, group: str) -> None:
        self.collective, self.group, self.collective_since = name, group, time.time()

    def clear_collective(self) -> None:
        self.collective = self.group = self.collective_since = None

    def step_done(self, step: int) -> None:
        self.steps_done, self.last_step_end = step, time.time()

    def snapshot(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "host": self.host,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "step": self.step,
            "steps_done": self.steps_done,
            "phase": self.phase,
            "phase_since": self.phase_since,
            "collective": self.collective,
            "group": self.group,
            "collective_since": self.collective_since,
            "pp_stage": self.pp_stage,
            "pp_microbatch": self.pp_microbatch,
            "pp_action": self.pp_action,
            "fault": self.fault,
            "last_step_end": self.last_step_end,
            "heartbeat": time.time(),
        }


def state_path(state_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(state_dir) / f"rank{rank}.json"


class Heartbeat:
    """Publishes ``state.snapshot()`` every ``interval_s`` from a daemon thread (file and/or callback)."""

    def __init__(
        self,
        state: RankState,
        *,
        state_dir: str | None = None,
        on_state: Callable[[dict[str, Any]], None] | None = None,
        interval_s: float = HEARTBEAT_S,
    ) -> None:
        self.state, self.on_state, self.interval_s = state, on_state, interval_s
        self.path = state_path(state_dir, state.rank) if state_dir else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> Heartbeat:
        if self.path is None and self.on_state is None:
            return self
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"meshrun-heartbeat-{self.state.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def beat(self) -> None:
        snap = self.state.snapshot()
        try:
            if self.path is not None:
                tmp = self.path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(snap))
                os.replace(tmp, self.path)
            if self.on_state is not None:
                self.on_state(snap)
        except Exception as e:  # never let diagnostics break training
            if not self._warned:
                self._warned = True
                log.warning("rank %d: cannot publish its state (%s: %s)", self.state.rank, type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.beat()


# ------------------------------------------------------------------------------------------------ stacks
_stack_files: dict[int, Any] = {}


def install_stack_dump(state_dir: str | None, rank: int) -> str | None:
    """``faulthandler`` on MESHRUN_STACK_SIGNAL (default SIGUSR1) dumps every thread's Python stack. Returns the
    file it appends to (None: stderr, or no signal support)."""
    signame = os.environ.get("MESHRUN_STACK_SIGNAL", "SIGUSR1")
    signum = getattr(signal, signame, None)
    if signum is None or not hasattr(faulthandler, "register"):
        return None
    path = None
    target: Any = None
    if state_dir:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        path = str(Path(state_dir) / f"rank{rank}.stacks.txt")
        old = _stack_files.pop(signum, None)
        if old is not None:
            old.close()
        target = open(path, "a")
        _stack_files[signum] = target
    try:
        if target is not None:
            faulthandler.register(signum, file=target, all_threads=True, chain=False)
        else:
            faulthandler.register(signum, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError) as e:
        log.warning("cannot register the stack dump on %s: %s", signame, e)
        return None
    return path


def dump_stacks(pid: int, *, timeout_s: float = 30.0) -> str:
    """Every thread's Python stack of process ``pid``: ``py-spy dump`` if installed (needs ptrace rights), else
    the stack-dump signal (the output then goes where the process registered it)."""
    exe = shutil.which("py-spy")
    if exe:
        try:
            p = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
            if p.returncode == 0:
                return p.stdout
            log.warning("py-spy dump --pid %d failed: %s", pid, p.stderr.strip()[-500:])
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("py-spy dump --pid %d failed: %s", pid, e)
    signum = getattr(signal, os.environ.get("MESHRUN_STACK_SIGNAL", "SIGUSR1"))
    os.kill(pid, signum)
    return f"(sent {signal.Signals(signum).name} to {pid}: the stacks go to its rank<r>.stacks.txt or stderr)"


# ------------------------------------------------------------------------------------------ hang summary
def read_states(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    out = []
    for p in sorted(Path(state_dir).glob("rank*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda s: s.get("rank", 0))


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def describe_hang(
    states: list[dict[str, Any]], *, world_size: int | None = None, now: float | None = None, stale_s: float = 30.0
) -> str:
    """One line naming the rank(s) most likely at fault and what the others wait in."""
    now = time.time() if now is None else now
    world_size = world_size or max([s.get("world_size", 0) for s in states] + [len(states)])
    seen = {int(s["rank"]) for s in states}
    parts: list[str] = []
    missing = [r for r in range(world_size) if r not in seen]
    stale = [int(s["rank"]) for s in states if now - float(s.get("heartbeat", now)) > stale_s]
    if missing:
        parts.append(f"{_ranks_text(missing)}: no state (process gone or never started)")
    if stale:
        parts.append(f"{_ranks_text(stale)}: no heartbeat for over {stale_s:.0f} s (process dead or frozen)")
    live = [s for s in states if int(s["rank"]) not in stale]
    stuck = [s for s in live if not s.get("collective")]
    waiting = [s for s in live if s.get("collective")]
    if not stuck and waiting:  # everybody waits: blame the group at the earliest step, then the smallest group
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in waiting:
            groups.setdefault((s["collective"], s.get("group") or "?"), []).append(s)
        culprit = min(groups, key=lambda k: (min(x["step"] for x in groups[k]), len(groups[k])))
        stuck = groups.pop(culprit)
        waiting = [s for g in groups.values() for s in g]
    by_what: dict[str, list[int]] = {}
    for s in stuck:
        if s.get("collective"):
            what = f"stuck in {s['collective']} ({s.get('group')} group) at step {s['step']}"
        else:
            what = f"stuck in {s.get('phase')} at step {s['step']}"
        if s.get("pp_stage") is not None and s.get("phase") == "compute":
            what += f" (pp stage {s['pp_stage']}, micro-batch {s['pp_microbatch']} {s.get('pp_action')})"
        if s.get("fault"):
            what += f" (injected {s['fault']})"
        since = s.get("collective_since") or s.get("phase_since")
        if since:
            what += f" for {now - float(since):.0f} s"
        by_what.setdefault(what, []).append(int(s["rank"]))
    for what, ranks in by_what.items():
        parts.insert(0, f"{_ranks_text(ranks)} {what}")
    waits: dict[str, list[int]] = {}
    for s in waiting:
        waits.setdefault(f"waiting in {s['collective']} ({s.get('group')})", []).append(int(s["rank"]))
    for what, ranks in waits.items():
        parts.append(f"{_ranks_text(ranks)} {what}")
    return "; ".join(parts) or "no rank state available"


# ------------------------------------------------------------------------------------------------ faults
class FaultInjector:
    """Applies ``spec.faults`` to this rank (see the module docstring)."""

    def __init__(self, faults: Any, *, rank: int, attempt: int, state: RankState) -> None:
        self.state, self.rank = state, rank
        self.slow_s = 0.0
        self.hang_at: int | None = None
        self.kill_at: int | None = None
        if faults is None:
            return
        if faults.slow_rank is not None and faults.slow_rank.rank == rank:
            self.slow_s = float(faults.slow_rank.delay_s)
        if attempt == 1:
            if faults.hang_rank is not None and faults.hang_rank.rank == rank:
                self.hang_at = int(faults.hang_rank.at_step)
            if faults.kill_rank is not None and faults.kill_rank.rank == rank:
                self.kill_at = int(faults.kill_rank.at_step)

    @property
    def active(self) -> bool:
        return bool(self.slow_s or self.hang_at or self.kill_at)

    def before_step(self, step: int) -> None:
        if self.kill_at == step:
            log.error("rank %d: injected fault kill_rank at step %d: SIGKILL", self.rank, step)
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def in_compute(self, step: int) -> None:
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.hang_at == step:
            self.state.fault = "hang_rank"
            log.error("rank %d: injected fault hang_rank at step %d: blocking forever", self.rank, step)
            while True:
                time.sleep(3600)
