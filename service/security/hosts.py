"""Which hosts a request may address, and which browser origins may act on the service.

DNS rebinding: a web page on ``attacker.example`` can make its own name resolve to 127.0.0.1 and then call the
service from the browser as a same-origin page; the browser sends ``Host: attacker.example``. Refusing every Host
that is not this service's own name closes that door before any route runs:

- loopback names (``localhost``, ``127.0.0.1``, ``::1``) and any IP address literal (no DNS name: nothing to
  rebind),
- ``MESHRUN_HOST`` when it is a name, the host of ``MESHRUN_PUBLIC_URL``,
- each ``MESHRUN_ALLOWED_HOSTS`` entry (``*`` accepts every host, for a proxy that checks Host itself).

A browser's ``Origin`` is accepted only when its host is in that same list and it is not the Ray dashboard's own
origin (``origin_allowed``; ``service.app.ray_origin``); with auth off a
request from any other browser origin, or a fetch the browser marks ``Sec-Fetch-Site: cross-site``, is never the
local user (``browser_foreign``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from service.settings import LOOPBACK_HOSTS, Settings

__all__ = ["HostPolicy", "host_name"]


def host_name(value: str) -> str:
    """The host name of a ``Host`` header value or an origin's netloc, lower-cased, without port or brackets."""
    v = value.strip().lower()
    if v.startswith("["):  # [::1]:8000
        return v[1:].split("]", 1)[0]
    if v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def _port(netloc: str) -> int | None:
    """The explicit port of an origin's netloc (``host:8001``, ``[::1]:8001``), or None."""
    tail = netloc.rsplit("]", 1)[-1] if netloc.startswith("[") else netloc
    if tail.count(":") != 1:
        return None
    port = tail.rsplit(":", 1)[1]
    return int(port) if port.isdigit() and len(port) <= 5 else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """The allow-list of one service's settings."""

    def __init__(self, settings: Settings):
        names = set(LOOPBACK_HOSTS) | set(settings.allowed_hosts)
        if settings.host and settings.host not in ("0.0.0.0", "::"):
            names.add(host_name(settings.host))
        if settings.public_url:
            public = urlsplit(settings.public_url).hostname
            if public:
                names.add(public.lower())
        self.any = "*" in names
        self.names = frozenset(names - {"*"})
        # the Ray dashboard's own origin (service.app.ray_origin): a page there is never one of the service's
        self.ray_port = settings.ray_proxy_listen_port

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request may address this Host (a request without one, HTTP/1.0, names no other site)."""
        if self.any or not host:
            return True
        name = host_name(host)
        return name in self.names or _is_ip(name)

    def origin_allowed(self, origin: str, addressed: Mapping[str, str]) -> bool:
        """Whether a browser page of this ``Origin`` header is one of this service's own origins: its host is in the
        allow-list by name, or it is the very host:port the request addressed (``Host``, or the ``X-Forwarded-Host``
        of a reverse proxy) and that one is allowed (a console opened at an IP address). An IP address alone is no
        reason to trust an origin: a page of another site may be served from one."""
        if origin == "null" or "://" not in origin:
            return False
        scheme, _, netloc = origin.lower().partition("://")
        netloc = netloc.rstrip("/")
        if scheme not in ("http", "https") or not netloc:
            return False
        if self.ray_port is not None and _port(netloc) == self.ray_port:
            return False
        if self.any or host_name(netloc) in self.names:
            return True
        hosts = {addressed.get("host", "").lower()}
        forwarded = addressed.get("x-forwarded-host")
        if forwarded:
            hosts.add(forwarded.split(",", 1)[0].strip().lower())
        return netloc in hosts and self.host_allowed(netloc)

    def browser_foreign(self, headers: Mapping[str, str]) -> bool:
        """True for a request a browser sends on behalf of another site: an ``Origin`` outside the allow-list, or
        ``Sec-Fetch-Site: cross-site``. Such a request is never the local user of an auth-off service."""
        if headers.get("sec-fetch-site", "").lower() == "cross-site":
            return True
        origin = headers.get("origin")
        return origin is not None and not self.origin_allowed(origin, headers)

    def refusal(self, host: str) -> str:
        name = host_name(host)[:100]
        return (
            f"Host '{name}' is not one of this service's names; if clients reach it as '{name}', add it to "
            "MESHRUN_ALLOWED_HOSTS (comma-separated) or set MESHRUN_PUBLIC_URL to its URL"
        )
