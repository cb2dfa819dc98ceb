"""What a spec may name: user code (only tokens allowed to run code) and paths or URLs (only under the allowed
roots and protocols when auth is on).

``check_spec_policy(spec, can_run_code=..., settings=..., admin=...)`` raises ``PolicyViolation`` (403 for user code
without permission, or for a ``faults`` section from a non-admin token while ``MESHRUN_ALLOW_FAULTS`` is off; 422
for a path or URL that is not allowed). Nothing in a spec is ever eval'd or run in a shell: entrypoints are validated
as dotted identifiers (``api.spec``) and imported by the workers with importlib.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from api.spec import RunSpec
from service.errors import MeshrunError
from service.settings import Settings

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class PolicyViolation(MeshrunError):
    """403 (``forbidden``: user code without permission) or 422 (``invalid_path``: a path or URL not allowed)."""

    def __init__(self, status_code: int, code: str, message: str, param: str | None = None):
        super().__init__(message, status_code=status_code, code=code, param=param)


@dataclass(frozen=True)
class _PathRule:
    param: str
    value: str | None


def uses_user_code(spec: RunSpec) -> str | None:
    """The field naming user code, if any."""
    if spec.model.entrypoint is not None or spec.model.name == "custom":
        return "model.entrypoint"
    if spec.data.entrypoint is not None or spec.data.source == "custom":
        return "data.entrypoint"
    if spec.code is not None and spec.code.working_dir is not None:
        return "code.working_dir"
    return None


def check_path(value: str, *, param: str, settings: Settings, restrict_roots: bool) -> None:
    """Validate a path or URL named in a spec. Raises PolicyViolation(422)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise PolicyViolation(
            422, "invalid_path", f"{param} contains control characters (NUL, newline, ...); remove them", param
        )
    if not value.strip():
        raise PolicyViolation(422, "invalid_path", f"{param} is empty; give a path or remove the field", param)
    m = _SCHEME_RE.match(value)
    path = value
    if m:
        scheme = m.group(1).lower()
        if scheme not in settings.allowed_url_schemes:
            raise PolicyViolation(
                422,
                "invalid_path",
                f"{param}: URL scheme '{scheme}' is not allowed; use one of "
                f"{sorted(settings.allowed_url_schemes)} or a plain path",
                param,
            )
        if scheme != "file":
            if ".." in PurePosixPath(value[m.end() :]).parts:
                raise PolicyViolation(422, "invalid_path", f"{param} must not contain '..' components", param)
            return
        path = value[m.end() :]
    parts = PurePosixPath(path.replace("\\", "/")).parts
    if ".." in parts:
        raise PolicyViolation(
            422,
            "invalid_path",
            f"{param} must not contain '..' components (no traversal out of "
            "the storage root); give the path without them",
            param,
        )
    if restrict_roots and (path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path)):
        roots = [settings.data_dir, settings.checkpoint_root, *settings.allowed_path_roots]
        p = PurePosixPath(path)
        if not any(root is not None and _is_under(p, PurePosixPath(str(root))) for root in roots):
            shown = ", ".join(str(r) for r in roots if r is not None)
            raise PolicyViolation(
                422,
                "invalid_path",
                f"{param}='{value}' is outside the allowed storage roots "
                f"({shown}); use a relative path, a path under them, or an object-store URL",
                param,
            )


def _is_under(p: PurePosixPath, root: PurePosixPath) -> bool:
    return p == root or root in p.parents


def check_spec_policy(spec: RunSpec, *, can_run_code: bool, settings: Settings, admin: bool = False) -> None:
    """Refuse what the caller may not submit (user code without permission; injected faults without admin rights
    or ``MESHRUN_ALLOW_FAULTS``; paths out of bounds)."""
    if spec.faults is not None and not (admin or settings.allow_faults):
        raise PolicyViolation(
            403,
            "forbidden",
            "faults: injected faults (chaos testing) need an admin token, or the service setting "
            "MESHRUN_ALLOW_FAULTS=true; remove the faults section or ask an admin",
            "faults",
        )
    code_field = uses_user_code(spec)
    if code_field and not can_run_code:
        raise PolicyViolation(
            403,
            "forbidden",
            f"{code_field}: this token may not run user code; ask an admin for "
            "a token created with --can-run-code, or use a built-in model and data source",
            code_field,
        )
    restrict = settings.auth_enabled
    code_dir = spec.code.working_dir if spec.code is not None else None
    for rule in (
        _PathRule("data.path", spec.data.path),
        _PathRule("checkpoint.storage", spec.checkpoint.storage),
        _PathRule("code.working_dir", code_dir),
    ):
        if rule.value is not None:
            check_path(rule.value, param=rule.param, settings=settings, restrict_roots=restrict)
    if code_dir is not None:  # the service ships user code from its own filesystem
        why = check_code_dir(spec, settings)
        if why:
            raise PolicyViolation(422, "invalid_path", why, "code.working_dir")


def resolve_code_dir(working_dir: str, settings: Settings) -> Path:
    """Absolute as given; relative to the service's data_dir."""
    p = Path(working_dir).expanduser()
    return p if p.is_absolute() else Path(settings.data_dir) / p


def check_code_dir(spec: RunSpec, settings: Settings) -> str | None:
    """Why ``spec.code.working_dir`` cannot be shipped from this service host (None = fine)."""
    if spec.code is None or spec.code.working_dir is None:
        return None
    p = resolve_code_dir(spec.code.working_dir, settings)
    if not p.is_dir():
        return (
            f"code.working_dir '{spec.code.working_dir}' is not a directory on the service host (looked at {p}); "
            "give the directory that holds your package (relative paths are under the service's data_dir)"
        )
    return None
