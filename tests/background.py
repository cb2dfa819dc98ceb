"""Checks that are one CPU-bound command and need nothing of the session (mypy over the packages) start in a
background process as soon as a serial session has collected their test, at the lowest CPU priority, and the test
collects the command's result.

A serial run starts with the shared Ray cluster's stretch, which keeps the two cores only about two thirds busy (the
rest is waiting on Ray's process starts, paced runs and polls): the command takes mostly that idle time (``nice -n
19``: below the test process and Ray's workers, which Ray starts at 15), and its test, later in the run, finds it done
instead of spending a minute on it. Under xdist, or when the test is not in the session, the test runs its command
itself, as before.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    test: str  # the node id of the test that collects it
    timeout_s: float = 900


COMMANDS = {
    "mypy": Command(
        (sys.executable, "-m", "mypy", "api", "service", "workers"),
        "tests/test_types.py::test_mypy_finds_nothing_in_api_service_and_workers",
    ),
}


@dataclass
class _Started:
    proc: subprocess.Popen[str]
    out: IO[str]
    err: IO[str]


_started: dict[str, _Started] = {}


def start(name: str) -> None:
    """Starts ``name``'s command in the background at the lowest CPU priority (once)."""
    if name in _started:
        return
    nice = ("nice", "-n", "19") if shutil.which("nice") else ()
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files, not pipes: read only at the end
    proc = subprocess.Popen([*nice, *COMMANDS[name].argv], cwd=ROOT, stdout=out, stderr=err, text=True)
    _started[name] = _Started(proc, out, err)


def result(name: str) -> subprocess.CompletedProcess[str]:
    """``name``'s command's result: the background run's, waited for, if the session started one; else run now."""
    cmd = COMMANDS[name]
    bg = _started.pop(name, None)
    if bg is None:
        return subprocess.run(cmd.argv, cwd=ROOT, capture_output=True, text=True, timeout=cmd.timeout_s)
    try:
        rc = bg.proc.wait(timeout=cmd.timeout_s)
    except subprocess.TimeoutExpired:
        bg.proc.kill()
        raise
    bg.out.seek(0)
    bg.err.seek(0)
    got = subprocess.CompletedProcess(bg.proc.args, rc, bg.out.read(), bg.err.read())
    bg.out.close()
    bg.err.close()
    return got


def stop_all() -> None:
    """Ends what the session started and no test collected (``-x``, an interrupt)."""
    for name in list(_started):
        bg = _started.pop(name)
        if bg.proc.poll() is None:
            bg.proc.kill()
            bg.proc.wait()
        bg.out.close()
        bg.err.close()


class BackgroundChecks:
    """The plugin (``tests/conftest.py`` registers it in a serial session only, not under xdist)."""

    @pytest.hookimpl(trylast=True)  # the final list: after ``-m``, ``-k`` and deselection
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        ids = {item.nodeid for item in session.items}
        for name, cmd in COMMANDS.items():
            if cmd.test in ids:
                start(name)

    def pytest_sessionfinish(self) -> None:
        stop_all()
