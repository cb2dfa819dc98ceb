"""What makes a checkpoint directory trustworthy: per-rank manifests (every file a rank wrote, with its size and
sha256), written after the rank's data and before the directory is published, and ``verify_checkpoint`` that
checks them. A crash or a full disk in the middle of a save leaves either an unpublished temporary directory or
a directory whose manifest does not match its files, never one that verifies.

Files of one checkpoint directory: DCP's ``__<rank>_*.distcp`` and ``.metadata``, ``manifest.rank<r>.json`` per
rank, and ``meshrun.json`` (rank 0, last; ``world_size`` says how many manifests to expect).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

META_FILE = "meshrun.json"
PARTIAL_SUFFIX = ".partial"  # a save in progress writes here; renamed to the final name when complete
MANIFEST_PREFIX = "manifest.rank"
_CHUNK = 1 << 20
logger = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_PREFIX}{rank}.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write, flush to disk, then rename into place: readers see the old file, the whole new one, or none."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, rank: int, files: list[str]) -> None:
    """Record ``files`` (names in ``directory`` written by this rank) with their sizes and checksums."""
    entries = {}
    for name in sorted(files):
        p = directory / name
        entries[name] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    write_json_atomic(directory / manifest_name(rank), {"rank": rank, "files": entries})


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted (None: complete and intact). Checks ``meshrun.json``, one
    manifest per saved rank, and every listed file's size (and sha256 with ``checksums``)."""
    d = Path(path)
    meta_p = d / META_FILE
    if not meta_p.is_file():
        return f"{d} has no {META_FILE} (the save did not finish)"
    try:
        meta = json.loads(meta_p.read_text())
        world = int(meta.get("world_size", 1))
    except (OSError, ValueError, TypeError) as e:
        return f"{d}/{META_FILE} is unreadable ({e})"
    if meta.get("manifests") is None:  # written before manifests existed: nothing more to check
        return None
    for rank in range(world):
        mp = d / manifest_name(rank)
        try:
            files = json.loads(mp.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{d} lacks a readable {mp.name} (rank {rank}'s part is missing)"
        for name, want in files.items():
            fp = d / name
            try:
                size = fp.stat().st_size
            except OSError:
                return f"{d}/{name} is missing"
            if size != want.get("size"):
                return f"{d}/{name} has {size} bytes, its manifest says {want.get('size')} (truncated write)"
            if checksums and _sha256(fp) != want.get("sha256"):
                return f"{d}/{name} does not match its checksum (corrupted)"
    return None


def remove_partial_saves(root: str | os.PathLike) -> list[Path]:
    """Delete the unpublished ``*.partial`` directories directly under ``root`` (a save interrupted by a crash or
    ENOSPC); returns them. Only when no save into ``root`` is in progress."""
    rootp = Path(root)
    gone = [d for d in (rootp.iterdir() if rootp.is_dir() else []) if d.is_dir() and d.name.endswith(PARTIAL_SUFFIX)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
        logger.warning("removed the partial checkpoint %s (a save that did not finish)", d)
    return gone


def rank_files(directory: Path, rank: int) -> list[str]:
    """The DCP files of ``directory`` that ``rank`` wrote (rank 0 also ``.metadata``)."""
    mine = [f.name for f in directory.iterdir() if f.name.startswith(f"__{rank}_")]
    return [*mine, ".metadata"] if rank == 0 and (directory / ".metadata").exists() else mine


@contextlib.contextmanager
def removed_on_failure(staging: Path) -> Iterator[None]:
    """Delete ``staging`` (an unpublished save) when the block fails (a full disk, a crash of the writer), so it
    neither holds the space nor looks like a checkpoint; the previous checkpoint stays the one to resume from."""
    try:
        yield
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- the checkpoints of a directory
def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """The conventional directory of the checkpoint of ``step`` under ``root``: ``root/step_00000042``."""
    return Path(root) / f"step_{int(step):08d}"


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Total size of the files of a checkpoint directory (recursive)."""
    total = 0
    for dirpath, _, files in os.walk(os.fspath(path)):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:  # removed while walking
                pass
    return total


_STEP_RE = re.compile(r"(\d+)$")


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (directories with ``meshrun.json``) directly under ``root``, oldest first."""
    out: list[tuple[int, Path]] = []
    rootp = Path(root)
    if not rootp.is_dir():
        return out
    for d in rootp.iterdir():
        if not d.is_dir() or not (d / META_FILE).is_file() or verify_checkpoint(d, checksums=False) is not None:
            continue
        try:
            step = int(json.loads((d / META_FILE).read_text())["step"])
        except (ValueError, KeyError, json.JSONDecodeError):
            m = _STEP_RE.search(d.name)
            if not m:
                continue
            step = int(m.group(1))
        out.append((step, d))
    out.sort(key=lambda t: (t[0], t[1].name))
    return out


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    cps = list_checkpoints(root)
    return cps[-1][1] if cps else None


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``; returns what was deleted.
    Unpublished ``*.partial`` directories (a save that crashed or hit a full disk) go too. Call it on one rank
    (rank 0) after the save's barrier (no save is in progress then)."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    remove_partial_saves(root)
    cps = list_checkpoints(root)
    doomed = [p for _, p in cps[:-keep]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        logger.info("pruned checkpoint %s", p)
    return doomed
