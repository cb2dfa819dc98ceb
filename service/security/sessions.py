"""Web console sessions: a browser signs in once with an API token and then carries an HttpOnly cookie.

The cookie holds a random secret (256 bits); only its SHA-256 is stored (``console_sessions``), with the token it
was opened with and a CSRF token that unsafe requests made with the cookie must echo in ``X-CSRF-Token``. A session
ends when it expires, when the user signs out, or when its API token is revoked (it is checked on every request).
The API token itself never leaves the sign-in form's POST body: it is not stored in the cookie, a URL or a log.
"""

from __future__ import annotations

import hmac
import secrets
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.security.tokens import hash_secret, verify_token
from service.store.models import ApiToken, ConsoleSession, utcnow

SESSION_COOKIE = "meshrun_session"
CSRF_HEADER = "X-CSRF-Token"
MAX_SECRET_CHARS = 128


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def open_session(session: Session, *, token_secret: str, ttl_s: float) -> tuple[str, ConsoleSession] | None:
    """A new session for the live API token ``token_secret``: (cookie secret, row), or None for a bad token.
    Expired sessions are swept on the way."""
    tok = verify_token(session, token_secret)
    if tok is None:
        return None
    now = utcnow()
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at < now))
    secret = secrets.token_urlsafe(32)
    row = ConsoleSession(
        session_hash=hash_secret(secret),
        token_id=tok.id,
        csrf_token=secrets.token_urlsafe(24),
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
    )
    session.add(row)
    session.flush()
    return secret, row


def find_session(session: Session, secret: str | None) -> tuple[ConsoleSession, ApiToken] | None:
    """The live session of a cookie secret and its (not revoked) API token, or None."""
    if not secret or len(secret) > MAX_SECRET_CHARS:
        return None
    digest = hash_secret(secret)
    found = session.execute(
        select(ConsoleSession, ApiToken)
        .join(ApiToken, ApiToken.id == ConsoleSession.token_id)
        .where(ConsoleSession.session_hash == digest)
    ).first()
    if found is None:
        return None
    row, tok = found
    if not hmac.compare_digest(row.session_hash, digest) or tok.revoked_at is not None:
        return None
    if _aware(row.expires_at) <= utcnow():
        return None
    return row, tok


def close_session(session: Session, secret: str | None) -> None:
    if secret and len(secret) <= MAX_SECRET_CHARS:
        session.execute(delete(ConsoleSession).where(ConsoleSession.session_hash == hash_secret(secret)))


def csrf_ok(row: ConsoleSession, presented: str | None) -> bool:
    return bool(presented) and hmac.compare_digest(row.csrf_token, presented or "")
