"""What a spec may name: user code (only tokens allowed to run code) and paths or URLs (only under the allowed
roots and protocols when auth is on).

``check_spec_policy(spec, can_run_code=..., settings=..., admin=...)`` raises ``PolicyViolation`` (403 for user code
without permission, or for a ``faults`` section from a non-admin token while ``MESHRUN_ALLOW_FAULTS`` is off; 422
for a path or URL that is not allowed). Nothing in a spec is ever eval'd or run in a shell: entrypoints are validated
as dotted identifiers (``api.spec``) and imported by the workers with importlib.
"""

from __future__ import annotations

import os
from pathlib import Path

from api.spec import RunSpec
from service.security.paths import PolicyViolation, decide_path, project_checkpoint_root, storage_problem
from service.security.tracking import check_tracking
from service.settings import Settings

__all__ = ["PolicyViolation", "check_code_dir", "check_spec_policy", "resolve_code_dir", "uses_user_code"]


def uses_user_code(spec: RunSpec) -> str | None:
    """The field naming user code, if any."""
    if spec.model.entrypoint is not None or spec.model.name == "custom":
        return "model.entrypoint"
    if spec.data.entrypoint is not None or spec.data.source == "custom":
        return "data.entrypoint"
    if spec.code is not None and spec.code.working_dir is not None:
        return "code.working_dir"
    return None


def check_spec_policy(
    spec: RunSpec, *, can_run_code: bool, settings: Settings, admin: bool = False, project: str | None = None
) -> RunSpec:
    """Refuse what the caller may not submit (user code without permission; injected faults without admin rights
    or ``MESHRUN_ALLOW_FAULTS``; paths out of bounds). Returns the spec to store: for a caller held to the storage
    roots, its paths replaced by the normalised absolute paths that were checked (so the workers open exactly
    those). ``project``: the caller's project; a caller other than an admin may then name no checkpoint directory
    of another project, and the checkpoint storage checked by default is the project's own root."""
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
    # tokens that may run code can read any file their code could; code.working_dir is read by the service itself
    # (from its own filesystem), so it stays under the roots for every caller when auth is on
    restricted = settings.auth_enabled and not can_run_code
    walled = None if admin else project
    code_dir = spec.code.working_dir if spec.code is not None else None
    data_path = spec.data.path
    storage = spec.checkpoint.storage
    if data_path is not None:
        data_path = decide_path(
            data_path, param="data.path", settings=settings, restricted=restricted, walled_to=walled, tree=True
        )
    model_path = spec.model.path
    if model_path is not None:  # a Hugging Face directory (model: {name: hf}): read by the service and the workers
        model_path = decide_path(
            model_path, param="model.path", settings=settings, restricted=restricted, walled_to=walled, tree=True
        )
    if storage is not None:
        storage = decide_path(
            storage, param="checkpoint.storage", settings=settings, restricted=restricted, walled_to=walled
        )
    target = storage or (project_checkpoint_root(settings, project) if project else str(settings.checkpoint_root))
    if "://" not in target and not os.path.isabs(os.path.expanduser(target)):
        target = os.path.join(str(settings.data_dir), target)
    unwritable = storage_problem(target)
    if unwritable:
        raise PolicyViolation(
            422,
            "storage_unwritable",
            f"checkpoint.storage: {unwritable}; give a writable directory or an object-store URL",
            "checkpoint.storage",
        )
    if code_dir is not None:
        decide_path(
            code_dir, param="code.working_dir", settings=settings, restricted=settings.auth_enabled, walled_to=walled
        )
        why = check_code_dir(spec, settings)
        if why:
            raise PolicyViolation(422, "invalid_path", why, "code.working_dir")
    check_tracking(spec, settings=settings, restricted=restricted)
    if (data_path, storage, model_path) == (spec.data.path, spec.checkpoint.storage, spec.model.path):
        return spec
    return spec.model_copy(
        update={
            "model": spec.model.model_copy(update={"path": model_path}),
            "data": spec.data.model_copy(update={"path": data_path}),
            "checkpoint": spec.checkpoint.model_copy(update={"storage": storage}),
        }
    )


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
