"""API tokens.

Tokens: ``msr_<43 url-safe chars>`` (256 random bits). Only the SHA-256 hex digest and a short display prefix are
stored (``api_tokens``); the secret is shown once, when created. Verification hashes the presented secret and looks
the digest up (unique index), so a database leak does not leak usable tokens.

CLI hook: ``create_token(session, project, name, admin=False, can_run_code=False) -> secret``
(``meshrun token create --project P [--admin] [--can-run-code]``).

"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store import NotFound
from service.store.models import ApiToken, utcnow

if TYPE_CHECKING:
    pass

TOKEN_PREFIX = "msr_"
DISPLAY_PREFIX_CHARS = 12
PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TOKEN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


# ------------------------------------------------------------------------------------------------ tokens
def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def create_token(session: Session, project: str, name: str, admin: bool = False, can_run_code: bool = False) -> str:
    """Create a token for ``project`` and return its secret (shown once; only its hash is stored).
    The caller commits (``service.store.db.session_scope``)."""
    if not PROJECT_RE.fullmatch(project):
        raise ValueError(f"project '{project}' must be 1-64 letters, digits, '.', '_' or '-'")
    if not TOKEN_NAME_RE.fullmatch(name):
        raise ValueError(f"token name '{name}' must be 1-128 letters, digits, '.', '_', '@' or '-'")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(
            name=name,
            project=project,
            token_hash=hash_secret(secret),
            prefix=secret[:DISPLAY_PREFIX_CHARS],
            admin=admin,
            can_run_code=can_run_code,
        )
    )
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


def revoke_token(
    session: Session,
    *,
    token_id: int | None = None,
    prefix: str | None = None,
    name: str | None = None,
    project: str | None = None,
) -> int:
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
