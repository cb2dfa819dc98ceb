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

Never readable through a spec, whoever calls (``_secret``): ``<data_dir>/secrets`` and ``credentials_dir`` (the
database URL file the Ray Job drivers read), the database file, the Ray head's directory (its token). Checkpoints:
each project's runs write under ``<checkpoint_root>/projects/<project>`` (``project_checkpoint_root``); a caller
other than an admin may name no other part of ``checkpoint_root`` (another project's weights). Refusals name the
path as the caller wrote it and the rule, never what the file holds or how large it is.
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
SECRET_IN_DATA_DIR = ("secrets", "ray")
PROJECTS_DIR = "projects"
_SAFE_PROJECT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
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
    db_file = _db_file(settings)
    if db_file is not None and path.startswith(db_file):
        return True
    if _under(path, data_dir) and path != data_dir:
        first = PurePosixPath(path[len(data_dir) :].lstrip("/")).parts[0]
        return first in RESERVED_IN_DATA_DIR or first.startswith("meshrun.db")
    return False


def _real(p: object) -> str:
    return os.path.realpath(os.path.expanduser(str(p)))


def _db_file(settings: Settings) -> str | None:
    db = settings.database_url
    if db.startswith("sqlite") and "///" in db:
        return os.path.realpath(db.split("///", 1)[1].split("?", 1)[0])
    return None


def _secret_locations(settings: Settings) -> list[str]:
    data_dir = _real(settings.data_dir)
    out = [os.path.join(data_dir, d) for d in SECRET_IN_DATA_DIR]
    if settings.credentials_dir is not None:
        out.append(_real(settings.credentials_dir))
    if settings.database_url_file is not None:
        out.append(_real(settings.database_url_file))
    db_file = _db_file(settings)
    if db_file is not None:
        out.append(db_file)
    return out


def _secret(path: str, settings: Settings, *, tree: bool) -> bool:
    """The service's credentials, database and Ray token (refused to every caller); with ``tree`` (a path read
    as a whole directory tree) also every directory that holds one of them."""
    # also its -wal / -shm / -journal; and the default SQLite file, which may be left from before PostgreSQL
    for db_file in (_db_file(settings), os.path.join(_real(settings.data_dir), "meshrun.db")):
        if db_file is not None and path.startswith(db_file):
            return True
    return any(_under(path, loc) or (tree and _under(loc, path)) for loc in _secret_locations(settings))


def project_checkpoint_root(settings: Settings, project: str) -> str:
    """Where the runs of ``project`` keep their checkpoints when their spec names no ``checkpoint.storage``."""
    name = project if _SAFE_PROJECT.fullmatch(project) else "x-" + project.encode().hex()[:120]
    return os.path.join(str(settings.checkpoint_root), PROJECTS_DIR, name)


def _other_project(path: str, settings: Settings, project: str, *, tree: bool) -> bool:
    """A path in ``checkpoint_root`` outside the caller's own project root (another project's checkpoints, or the
    shared directory of runs from before per-project roots); with ``tree`` also a directory that holds the
    checkpoint root."""
    root = _real(settings.checkpoint_root)
    if tree and _under(root, path):
        return True
    return _under(path, root) and not _under(path, _real(project_checkpoint_root(settings, project)))


def _local(
    path: str, *, param: str, settings: Settings, restricted: bool, walled_to: str | None = None, tree: bool = False
) -> str:
    """Normalise a local path (``~``, relative, symlinks); with ``restricted``, check it against the roots."""
    expanded = os.path.expanduser(path) if path.startswith("~") else path
    if expanded.startswith("~") and restricted:
        raise _refuse(param, f"'{path}' names a home directory that does not exist; give an absolute path")
    if not os.path.isabs(expanded):
        expanded = os.path.join(str(settings.data_dir), expanded)
    resolved = os.path.realpath(expanded)
    if _secret(resolved, settings, tree=tree):
        raise _refuse(
            param,
            f"'{path}' names the service's own credentials, database or Ray directory, which no spec may read; "
            "use your data's own directory",
        )
    if walled_to is not None and _other_project(resolved, settings, walled_to, tree=tree):
        raise _refuse(
            param,
            f"'{path}' lies in the checkpoint storage outside your project's own directory "
            f"({project_checkpoint_root(settings, walled_to)}); name a path there, or leave checkpoint.storage unset",
        )
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


def decide_path(
    value: str, *, param: str, settings: Settings, restricted: bool, walled_to: str | None = None, tree: bool = False
) -> str:
    """Judge one path or URL named by ``param``. Returns the normalised value (an absolute local path, or the
    URL as given); raises ``PolicyViolation`` (422 naming ``param``) for anything not allowed. ``walled_to``: the
    project of a caller who is not an admin (other projects' checkpoints are refused); ``tree``: the path is read
    as a whole directory tree (``data.path``), so a directory holding a refused one is refused too."""
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
        local = _local(value, param=param, settings=settings, restricted=restricted, walled_to=walled_to, tree=tree)
        return local if restricted else value
    if proto not in LOCAL_PROTOCOLS:
        return value
    if len(links) > 1 and restricted:
        raise _refuse(param, "chained protocols over local files are not allowed; give a plain path")
    path = unquote(_file_url_path(rest, param=param))
    local = _local(path, param=param, settings=settings, restricted=restricted, walled_to=walled_to, tree=tree)
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
