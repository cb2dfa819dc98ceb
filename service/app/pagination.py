"""Opaque cursors of the paged list endpoints.

A cursor is the keyset of the last item of a page (e.g. ``created_at`` and ``id`` of a run), tagged with the list
it belongs to, as URL-safe base64 of JSON. Clients treat it as opaque: they pass a page's ``next_cursor`` back as
``cursor``. A cursor only moves within what the caller may see anyway (the filters and the project scope are
applied again), so it needs no signature; a malformed one, or one of another list, is a 422 naming ``cursor``.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any

from service.app.errors import ApiError

MAX_CURSOR_CHARS = 512


def encode_cursor(kind: str, *values: Any) -> str:
    """The cursor of list ``kind`` after the item with keyset ``values`` (str, int or datetime)."""
    plain = [v.isoformat() if isinstance(v, datetime) else v for v in values]
    raw = json.dumps([kind, *plain], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _bad(kind: str) -> ApiError:
    return ApiError(
        422,
        f"cursor is not a {kind} cursor of this list; pass the next_cursor of the previous page unchanged",
        param="cursor",
    )


def decode_cursor(cursor: str, kind: str, *types: type) -> tuple[Any, ...]:
    """The keyset values of a cursor made by ``encode_cursor(kind, ...)``, converted to ``types``."""
    if len(cursor) > MAX_CURSOR_CHARS:
        raise _bad(kind)
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise _bad(kind) from None
    if not isinstance(data, list) or len(data) != len(types) + 1 or data[0] != kind:
        raise _bad(kind)
    out: list[Any] = []
    for v, t in zip(data[1:], types):
        try:
            if t is datetime:
                if not isinstance(v, str):
                    raise ValueError
                out.append(datetime.fromisoformat(v))
            elif t is int:  # offsets, steps, attempts and ids: never negative
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
                    raise ValueError
                out.append(v)
            else:
                if not isinstance(v, str) or "\x00" in v:
                    raise ValueError
                v.encode("utf-8")  # a lone surrogate (JSON "\ud800") is no id any database can hold
                out.append(v)
        except (ValueError, UnicodeEncodeError):
            raise _bad(kind) from None
    return tuple(out)


def no_cursor_with_offset(cursor: str | None, offset: int) -> None:
    if cursor and offset:
        raise ApiError(422, "give either cursor or offset, not both; cursor is the faster way to page", param="offset")
