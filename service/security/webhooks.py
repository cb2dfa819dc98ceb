"""Webhook secrets and signatures.

A webhook's secret signs every delivery, so the service must be able to read it back (unlike an API token, of which
only a hash is kept). It is handled like a token everywhere else: 256 random bits (``mwh_<43 url-safe chars>``) unless
the caller brings one, shown once when the webhook is created, never returned by the API afterwards (only a display
prefix). In the database it is sealed: encrypted (HMAC-SHA256 in counter mode as the key stream) and authenticated
(HMAC-SHA256 over nonce and ciphertext) with the service's webhook key, so a leaked database leaks no usable secret.
The key is ``MESHRUN_WEBHOOK_KEY`` or a random one kept in ``<credentials_dir>/webhook.key`` (0600).

Signature of a delivery (``sign``): ``X-Meshrun-Signature: sha256=<hex HMAC-SHA256(secret, f"{timestamp}." + body)>``
with ``X-Meshrun-Timestamp: <unix seconds>``; a receiver recomputes it over the raw body and rejects old timestamps.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from service.settings import Settings

SECRET_PREFIX = "mwh_"
DISPLAY_PREFIX_CHARS = 8
SIGNATURE_HEADER = "X-Meshrun-Signature"
TIMESTAMP_HEADER = "X-Meshrun-Timestamp"
_NONCE = 16
_TAG = 32
_VERSION = "v1:"


class SealError(ValueError):
    """A sealed secret that does not open with this key (another key, or tampered with)."""


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def display_prefix(secret: str) -> str:
    return secret[:DISPLAY_PREFIX_CHARS]


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, timestamp: int, body: bytes, signature: str) -> bool:
    """What a receiver does (and the tests): constant-time comparison with the expected signature."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


# ------------------------------------------------------------------------------------------------ sealing
def _subkey(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, label, hashlib.sha256).digest()


def _stream(key: bytes, nonce: bytes, n: int) -> bytes:
    enc = _subkey(key, b"meshrun-webhook-enc")
    out = bytearray()
    block = 0
    while len(out) < n:
        out += hmac.new(enc, nonce + block.to_bytes(4, "big"), hashlib.sha256).digest()
        block += 1
    return bytes(out[:n])


def seal(secret: str, key: bytes) -> str:
    data = secret.encode("utf-8")
    nonce = os.urandom(_NONCE)
    ct = bytes(a ^ b for a, b in zip(data, _stream(key, nonce, len(data)), strict=True))
    tag = hmac.new(_subkey(key, b"meshrun-webhook-mac"), nonce + ct, hashlib.sha256).digest()
    return _VERSION + base64.urlsafe_b64encode(nonce + ct + tag).decode()


def unseal(sealed: str, key: bytes) -> str:
    if not sealed.startswith(_VERSION):
        raise SealError("unknown sealed-secret format")
    try:
        raw = base64.urlsafe_b64decode(sealed[len(_VERSION) :].encode())
    except ValueError as e:
        raise SealError("sealed secret is not base64") from e
    if len(raw) < _NONCE + _TAG:
        raise SealError("sealed secret is too short")
    nonce, ct, tag = raw[:_NONCE], raw[_NONCE:-_TAG], raw[-_TAG:]
    want = hmac.new(_subkey(key, b"meshrun-webhook-mac"), nonce + ct, hashlib.sha256).digest()
    if not hmac.compare_digest(want, tag):
        raise SealError("the webhook secret does not open with this service's webhook key (MESHRUN_WEBHOOK_KEY)")
    return bytes(a ^ b for a, b in zip(ct, _stream(key, nonce, len(ct)), strict=True)).decode("utf-8")


def webhook_key(settings: Settings) -> bytes:
    """``MESHRUN_WEBHOOK_KEY``, or the random key in ``<credentials_dir>/webhook.key`` (created 0600 on first use)."""
    if settings.webhook_key:
        return hashlib.sha256(settings.webhook_key.encode("utf-8")).digest()
    folder = Path(settings.credentials_dir or Path(settings.data_dir) / "secrets")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / "webhook.key"
    if not path.exists():  # written whole under a temporary name, then linked: a racing reader never sees half
        tmp = folder / f".webhook.key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    text = path.read_text().strip()
    if len(text) != 64:
        raise SealError(f"{path} does not hold a 64-hex-digit key; remove it to have a new one made")
    return bytes.fromhex(text)
