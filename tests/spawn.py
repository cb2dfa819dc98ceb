"""Rank processes for the multi-process tests, started through one fork server per test process.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter that imports torch and the engine again
(about 2 CPU-seconds a rank on this machine, most of what a tiny parity run costs); the suite starts some two hundred of
them. ``spawn_ranks`` starts them with the ``forkserver`` method instead: one server process imports torch and the
engine once (``PRELOAD``: imports only, no tensor op, no thread pool, no process group) and forks each rank from it.
Every rank is still its own process with its own gloo process group, as with ``spawn``.

A forked rank would see the server's environment (from when it started), so each rank takes the caller's current
environment with it (``monkeypatch.setenv`` before a run still reaches its ranks).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# imported once by the fork server (an import that fails is skipped by multiprocessing: the rank imports it itself)
PRELOAD = ["torch", "torch.distributed", "api.spec", "api.spec.validation", "workers.loop"]


def _rank(i: int, env: dict[str, str], fn: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(i, *args)


def spawn_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, each rank forked from the fork server."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(_rank, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True, start_method="forkserver")
