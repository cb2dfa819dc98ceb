"""API tokens and the submission policy (who may run user code, which paths a spec may name).

Tokens: ``msr_<43 url-safe chars>`` (256 random bits). Only the SHA-256 hex digest and a short display prefix are
stored (``api_tokens``); the secret is shown once, when created. Verification hashes the presented secret and looks
the digest up (unique index), so a database leak does not leak usable tokens.

CLI hook: ``create_token(session, project, name, admin=False, can_run_code=False) -> secret``
(``meshrun token create --project P [--admin] [--can-run-code]``).

Policy: ``check_spec_policy(spec, can_run_code=..., settings=...)`` raises ``PolicyViolation`` (403 for user code
without permission, 422 for a path/URL that is not allowed). Nothing in a spec is ever eval'd or run in a shell:
entrypoints are validated as dotted identifiers (api.schemas) and imported by the workers with importlib.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import ApiToken, utcnow
from service.store import NotFound

if TYPE_CHECKING:
    from api.schemas import RunSpec
    from service.settings import Settings

TOKEN_PREFIX = "msr_"
DISPLAY_PREFIX_CHARS = 12
PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TOKEN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


# ------------------------------------------------------------------------------------------------ tokens
def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def create_token(session: Session, project: str, name: str, admin: bool = False,
                 can_run_code: bool = False) -> str:
    """Create a token for ``project`` and return its secret (shown once; only its hash is stored).
    The caller commits (``service.db.session_scope``)."""
    if not PROJECT_RE.match(project):
        raise ValueError(f"project '{project}' must be 1-64 letters, digits, '.', '_' or '-'")
    if not TOKEN_NAME_RE.match(name):
        raise ValueError(f"token name '{name}' must be 1-128 letters, digits, '.', '_', '@' or '-'")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, project=project, token_hash=hash_secret(secret),
                         prefix=secret[:DISPLAY_PREFIX_CHARS], admin=admin, can_run_code=can_run_code))
    session.flush()
    return secret


def verify_token(session: Session, secret: str) -> ApiToken | None:
    """The live (not revoked) token with this secret, or None."""
    if not secret.startswith(TOKEN_PREFIX) or len(secret) > 256:
        return None
    digest = hash_secret(secret)
    tok = session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))
    if tok is None or tok.revoked_at is not None or not hmac.compare_digest(tok.token_hash, digest):
        return None
    return tok


def revoke_token(session: Session, *, token_id: int | None = None, prefix: str | None = None,
                 name: str | None = None, project: str | None = None) -> int:
    """Revoke tokens by id, display prefix, or (project, name). Returns how many were revoked."""
    stmt = select(ApiToken).where(ApiToken.revoked_at.is_(None))
    if token_id is not None:
        stmt = stmt.where(ApiToken.id == token_id)
    elif prefix is not None:
        stmt = stmt.where(ApiToken.prefix == prefix)
    elif name is not None:
        stmt = stmt.where(ApiToken.name == name)
        if project is not None:
            stmt = stmt.where(ApiToken.project == project)
    else:
        raise ValueError("give token_id, prefix or name")
    toks = list(session.scalars(stmt).all())
    if not toks:
        raise NotFound("no such live token", param="token")
    now = utcnow()
    for t in toks:
        t.revoked_at = now
    session.flush()
    return len(toks)


def list_tokens(session: Session, *, project: str | None = None) -> list[ApiToken]:
    stmt = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if project is not None:
        stmt = stmt.where(ApiToken.project == project)
    return list(session.scalars(stmt).all())


# ------------------------------------------------------------------------------------------------ policy
class PolicyViolation(Exception):
    """A spec the caller may not submit: 403 (permission) or 422 (a path/URL that is not allowed)."""

    def __init__(self, status_code: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status_code, self.code, self.message, self.param = status_code, code, message, param


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
        raise PolicyViolation(422, "invalid_path", f"{param} contains control characters (NUL, newline, ...); "
                              "remove them", param)
    if not value.strip():
        raise PolicyViolation(422, "invalid_path", f"{param} is empty; give a path or remove the field", param)
    m = _SCHEME_RE.match(value)
    path = value
    if m:
        scheme = m.group(1).lower()
        if scheme not in settings.allowed_url_schemes:
            raise PolicyViolation(422, "invalid_path", f"{param}: URL scheme '{scheme}' is not allowed; use one of "
                                  f"{sorted(settings.allowed_url_schemes)} or a plain path", param)
        if scheme != "file":
            if ".." in PurePosixPath(value[m.end():]).parts:
                raise PolicyViolation(422, "invalid_path", f"{param} must not contain '..' components", param)
            return
        path = value[m.end():]
    parts = PurePosixPath(path.replace("\\", "/")).parts
    if ".." in parts:
        raise PolicyViolation(422, "invalid_path", f"{param} must not contain '..' components (no traversal out of "
                              "the storage root); give the path without them", param)
    if restrict_roots and (path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path)):
        roots = [settings.data_dir, settings.checkpoint_root, *settings.allowed_path_roots]
        p = PurePosixPath(path)
        if not any(root is not None and _is_under(p, PurePosixPath(str(root))) for root in roots):
            shown = ", ".join(str(r) for r in roots if r is not None)
            raise PolicyViolation(422, "invalid_path", f"{param}='{value}' is outside the allowed storage roots "
                                  f"({shown}); use a relative path, a path under them, or an object-store URL",
                                  param)


def _is_under(p: PurePosixPath, root: PurePosixPath) -> bool:
    return p == root or root in p.parents


def check_spec_policy(spec: RunSpec, *, can_run_code: bool, settings: Settings) -> None:
    """Refuse what the caller may not submit (user code without permission; paths out of bounds)."""
    code_field = uses_user_code(spec)
    if code_field and not can_run_code:
        raise PolicyViolation(403, "forbidden", f"{code_field}: this token may not run user code; ask an admin for "
                              "a token created with --can-run-code, or use a built-in model and data source",
                              code_field)
    restrict = settings.auth_enabled
    code_dir = spec.code.working_dir if spec.code is not None else None
    for rule in (_PathRule("data.path", spec.data.path), _PathRule("checkpoint.storage", spec.checkpoint.storage),
                 _PathRule("code.working_dir", code_dir)):
        if rule.value is not None:
            check_path(rule.value, param=rule.param, settings=settings, restrict_roots=restrict)
    if code_dir is not None:  # the service ships user code from its own filesystem
        from service.inspect import check_code_dir

        why = check_code_dir(spec, settings)
        if why:
            raise PolicyViolation(422, "invalid_path", why, "code.working_dir")
