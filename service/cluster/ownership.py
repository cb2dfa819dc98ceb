"""Who owns the embedded Ray head: one service per data directory, one head per service, recorded on disk.

- ``HeadLock``: an exclusive ``flock`` on ``<data_dir>/ray/head.lock`` held while a service owns the head of that
  data directory; a second service on the same data directory fails at start with a clear message instead of
  starting a second head.
- ``HeadRecord``: ``<data_dir>/ray/head.json`` (0600, written atomically) records the head the service started:
  the pid and process group of ``ray start --head --block``, its ports, address, temp and session directories.
  A service that restarts after a crash reads it and adopts that head when it still answers, or stops what is
  left of it (``stop_recorded``) before it starts a new one on the same configured ports.
- ``check_port``: a configured port that something else holds is an error naming the setting (never a silent
  switch to another port).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

RECORD_NAME = "head.json"
# How long a stopping head gets after SIGTERM before what is left is killed. Its GCS, raylet and dashboard stop in
# about 2 s, but once a job has run, Ray's workers (idle ones, detached actors) wait about 30 s for their raylet
# before they exit, and ``ray start --block`` waits for them (measured on Ray 2.60). Nothing of a local head's
# state outlives it anyway (no external GCS storage), so the service does not wait that long.
STOP_GRACE_S = 5.0
LOCK_NAME = "head.lock"


class HeadOwnershipError(RuntimeError):
    """The embedded head cannot be started or adopted as configured (the message says what to change)."""


@dataclass
class HeadRecord:
    pid: int
    pgid: int
    gcs_port: int
    dashboard_port: int
    metrics_port: int | None
    address: str
    temp_dir: str
    session_dir: str | None
    started_at: float
    service_pid: int


def record_path(ray_dir: Path) -> Path:
    return ray_dir / RECORD_NAME


def load_record(ray_dir: Path) -> HeadRecord | None:
    path = record_path(ray_dir)
    try:
        data = json.loads(path.read_text())
        return HeadRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        logger.warning("ignoring unreadable head record %s: %s", path, e)
        return None


def save_record(ray_dir: Path, rec: HeadRecord) -> None:
    path = record_path(ray_dir)
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, path)


def clear_record(ray_dir: Path) -> None:
    try:
        record_path(ray_dir).unlink()
    except FileNotFoundError:
        pass


def session_dir_of(temp_dir: Path) -> str | None:
    """The head's session directory (``<temp_dir>/session_latest`` points at it)."""
    link = temp_dir / "session_latest"
    try:
        return str(link.resolve(strict=True))
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------ lock
class HeadLock:
    """An exclusive, non-blocking ``flock`` on ``<ray_dir>/head.lock`` (released by ``release`` or process exit)."""

    def __init__(self, ray_dir: Path):
        self.path = ray_dir / LOCK_NAME
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        if self._fh is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            fh.close()
            raise HeadOwnershipError(
                f"another meshrun service (pid {holder}) owns the Ray head of data directory "
                f"{self.path.parent.parent}; stop it, or give this service its own MESHRUN_DATA_DIR"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()


# ----------------------------------------------------------------------------------------------- processes
def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def is_ray_head(pid: int) -> bool:
    """Whether ``pid`` is a ``ray start --head`` process (a recycled pid is not)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [c.decode(errors="replace") for c in cmd]
    return "start" in args and "--head" in args and any("ray" in a for a in args)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a live member (zombies awaiting their reaper do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return bool(group_members(pgid))


def stop_recorded(rec: HeadRecord, *, timeout_s: float = STOP_GRACE_S) -> None:
    """Stop a head this service started before (its leader may be gone already): SIGTERM the leader, then
    SIGKILL its process group and every Ray process whose session directory is the head's."""
    if pid_alive(rec.pid) and is_ray_head(rec.pid):
        try:
            os.kill(rec.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pid_alive(rec.pid):
            time.sleep(0.2)
    if group_alive(rec.pgid):
        try:
            os.killpg(rec.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in _session_processes(rec):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session_processes(rec: HeadRecord) -> list[int]:
    """Processes that name the head's session directory on their command line (Ray workers and drivers
    run in process groups of their own)."""
    marks = [rec.session_dir.encode()] if rec.session_dir else []
    if not marks:
        return []
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmd for m in marks):
            out.append(int(entry.name))
    return out


def kill_process_group(proc: subprocess.Popen, *, timeout_s: float = STOP_GRACE_S) -> None:
    """Stop the process tree led by ``proc`` (started with start_new_session): SIGTERM the leader (``ray start
    --block`` then stops its children), wait up to ``timeout_s`` for the leader, its process group and its
    descendants (Ray workers may run in process groups of their own) to exit, then SIGKILL what is left."""
    try:
        import psutil
        import ray  # noqa: F401 - ray vendors psutil (ray/thirdparty_files)

        descendants = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        descendants = []
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (
        proc.poll() is None or group_alive(pgid) or any(_running(p) for p in descendants)
    ):
        time.sleep(0.2)
    if proc.poll() is None:
        logger.info("process %s did not stop within %.0fs of SIGTERM; killing its group", proc.pid, timeout_s)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in descendants:
        if _running(p):
            try:
                p.kill()
            except Exception:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:
        return False


# -------------------------------------------------------------------------------------------------- ports
def port_in_use(port: int, *, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def check_port(port: int, *, setting: str, wait_s: float = 10.0) -> None:
    """Raise ``HeadOwnershipError`` naming ``setting`` when ``port`` stays taken for ``wait_s`` (a head that was
    just stopped releases its ports within moments)."""
    if port == 6379:
        raise HeadOwnershipError(f"{setting}=6379 is Redis's port; choose another port for the Ray GCS")
    deadline = time.monotonic() + wait_s
    while port_in_use(port):
        if time.monotonic() > deadline:
            raise HeadOwnershipError(
                f"{setting}={port} is in use by another process; stop that process or set {setting} to a free port "
                "(meshrun does not move the Ray head to another port on its own)"
            )
        time.sleep(0.5)


__all__ = [
    "HeadLock",
    "HeadOwnershipError",
    "HeadRecord",
    "check_port",
    "clear_record",
    "is_ray_head",
    "group_alive",
    "group_members",
    "kill_process_group",
    "load_record",
    "pid_alive",
    "save_record",
    "session_dir_of",
    "stop_recorded",
]
