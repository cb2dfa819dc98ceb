"""The one path policy: ``decide_path`` judges every user-supplied path or URL of a spec (``data.path``,
``checkpoint.storage``, ``code.working_dir``) after normalising it the way the code that opens it would.

Normalisation: percent-decoding (repeated: ``%252e`` -> ``%2e`` -> ``.``), fsspec protocol chains
(``simplecache::file:///x``: every protocol of the chain must be allowed, the last link names the location),
``file:`` URLs in all their forms (``file:/x``, ``file:///x``, ``file://localhost/x``; another host is refused),
``~`` and ``~user`` (expanded as the workers would), relative paths (under the service's ``data_dir``) and symlinks
(``os.path.realpath``). Always refused: control characters, empty values, ``..`` components (raw or decoded) and
protocols outside ``settings.allowed_url_schemes``. With ``restricted`` (auth on and a token that may not run code)
a local path must also resolve under ``data_dir``, ``checkpoint_root`` or ``settings.allowed_path_roots``, outside
the service's own files there (the database, the Ray head's directory with its token, hidden entries); the caller
then gets the normalised absolute path back, so what runs is exactly what was checked.
"""

from __future__ import annotations

import os
import re
from pathlib import PurePosixPath
from urllib.parse import unquote

from service.errors import ServiceError
from service.settings import Settings

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # two letters or more: "C:" is a drive, not a scheme
_PROTOCOL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+$")
LOCAL_PROTOCOLS = frozenset({"file", "local"})
# entries of data_dir that belong to the service, never to a spec: the SQLite database (and its -wal/-shm), the Ray
# head's directory (its auth token), Ray Train's local staging and the sweeps' Tune storage
RESERVED_IN_DATA_DIR = ("ray", "tmp", "tune")
MAX_DECODE_ROUNDS = 4


class PolicyViolation(ServiceError):
    """403 (``forbidden``: user code without permission) or 422 (``invalid_path``: a path or URL not allowed)."""

    def __init__(self, status_code: int, code: str, message: str, param: str | None = None):
        super().__init__(message, status_code=status_code, code=code, param=param)


def _refuse(param: str, why: str) -> PolicyViolation:
    return PolicyViolation(422, "invalid_path", f"{param}: {why}", param)


def _decodings(value: str) -> list[str]:
    """``value`` and its successive percent-decodings until stable."""
    out = [value]
    for _ in range(MAX_DECODE_ROUNDS):
        nxt = unquote(out[-1], errors="strict") if "%" in out[-1] else out[-1]
        if nxt == out[-1]:
            break
        out.append(nxt)
    return out


def _has_control(s: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in s)


def _has_dotdot(s: str) -> bool:
    return ".." in PurePosixPath(s.replace("\\", "/")).parts


def _roots(settings: Settings) -> list[str]:
    roots = [settings.data_dir, settings.checkpoint_root, *settings.allowed_path_roots]
    return [os.path.realpath(os.path.expanduser(str(r))) for r in roots if r is not None]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _reserved(path: str, settings: Settings) -> bool:
    """A service-owned file or a hidden entry (``.ssh``, ``.bashrc``, a credential file)."""
    data_dir = os.path.realpath(os.path.expanduser(str(settings.data_dir)))
    if any(part.startswith(".") for part in PurePosixPath(path).parts[1:]):
        return True
    db = settings.database_url
    if db.startswith("sqlite") and "///" in db:
        db_file = os.path.realpath(db.split("///", 1)[1].split("?", 1)[0])
        if path.startswith(db_file):
            return True
    if _under(path, data_dir) and path != data_dir:
        first = PurePosixPath(path[len(data_dir) :].lstrip("/")).parts[0]
        return first in RESERVED_IN_DATA_DIR or first.startswith("meshrun.db")
    return False


def _local(path: str, *, param: str, settings: Settings, restricted: bool) -> str:
    """Normalise a local path (``~``, relative, symlinks); with ``restricted``, check it against the roots."""
    expanded = os.path.expanduser(path) if path.startswith("~") else path
    if expanded.startswith("~") and restricted:
        raise _refuse(param, f"'{path}' names a home directory that does not exist; give an absolute path")
    if not os.path.isabs(expanded):
        expanded = os.path.join(str(settings.data_dir), expanded)
    resolved = os.path.realpath(expanded)
    if not restricted:
        return resolved
    roots = _roots(settings)
    if not any(_under(resolved, r) for r in roots):
        shown = ", ".join(roots)
        raise _refuse(
            param,
            f"'{path}' resolves to {resolved}, outside the allowed storage roots ({shown}); use a path under them "
            "(relative paths are under the service's data_dir) or an object-store URL",
        )
    if _reserved(resolved, settings):
        raise _refuse(
            param,
            f"'{path}' resolves to {resolved}, which belongs to the service (its database, Ray directory or a "
            "hidden file); use another directory",
        )
    return resolved


def _split_url(link: str) -> tuple[str | None, str]:
    """(protocol or None, the rest) of one link of an fsspec chain."""
    m = _SCHEME_RE.match(link)
    if m is None:
        return None, link
    return m.group(1).lower(), link[m.end() :]


def _file_url_path(rest: str, *, param: str) -> str:
    """The local path of a ``file:`` URL's remainder: ``/x``, ``///x``, ``//localhost/x``."""
    if rest.startswith("//"):
        host, sep, tail = rest[2:].partition("/")
        if host.lower() not in ("", "localhost", "127.0.0.1"):
            raise _refuse(param, f"file URLs name no other host (got '{host}'); give a local path")
        rest = "/" + tail if sep else "/"
    if not rest.startswith("/"):
        raise _refuse(param, "a file: URL must hold an absolute path (file:///dir); or give a plain path")
    return rest


def decide_path(value: str, *, param: str, settings: Settings, restricted: bool) -> str:
    """Judge one path or URL named by ``param``. Returns the normalised value (an absolute local path, or the
    URL as given); raises ``PolicyViolation`` (422 naming ``param``) for anything not allowed."""
    if not value.strip():
        raise _refuse(param, "is empty; give a path or remove the field")
    try:
        forms = _decodings(value)
    except UnicodeDecodeError:
        raise _refuse(param, "holds percent-escapes that are not UTF-8; write the path unescaped") from None
    if any(_has_control(f) for f in forms):
        raise _refuse(param, "contains control characters (NUL, newline, ...); remove them")
    if any(_has_dotdot(f) for f in forms):
        raise _refuse(param, "must not contain '..' components (also not percent-encoded); give the path without them")
    links = value.split("::")
    allowed = {s.lower() for s in settings.allowed_url_schemes}
    for i, link in enumerate(links):
        proto = _split_url(link)[0]
        if proto is None and i < len(links) - 1:  # "simplecache::...": a bare protocol name before the last link
            if not _PROTOCOL_RE.fullmatch(link):
                raise _refuse(param, f"'{link}' is not a protocol name of an fsspec URL chain")
            proto = link.lower()
        if proto is not None and proto not in allowed:
            raise _refuse(param, f"protocol '{proto}' is not allowed; use one of {sorted(allowed)} or a plain path")
    proto, rest = _split_url(links[-1])
    if len(links) > 1 and proto is None:  # "simplecache::/etc/x": the last link is a bare local path
        proto = "file"
    if proto is None:
        local = _local(value, param=param, settings=settings, restricted=restricted)
        return local if restricted else value
    if proto not in LOCAL_PROTOCOLS:
        return value
    if len(links) > 1 and restricted:
        raise _refuse(param, "chained protocols over local files are not allowed; give a plain path")
    path = unquote(_file_url_path(rest, param=param))
    local = _local(path, param=param, settings=settings, restricted=restricted)
    return local if restricted else value


def storage_problem(storage: str) -> str | None:
    """Why the service cannot write checkpoints to the local directory ``storage`` (None: writable, or a URL the
    workers' filesystem library writes). A directory that does not exist yet is judged by its nearest existing
    parent, where it would be created."""
    if "://" in storage or "::" in storage:
        return None
    p = os.path.realpath(os.path.expanduser(storage))
    probe = p
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory, so {p} cannot hold checkpoints"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by the service (read-only or permissions), so {p} cannot hold checkpoints"
    return None
