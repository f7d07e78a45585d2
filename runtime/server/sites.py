"""Which web sites may drive the server: the defenses against cross-site requests and DNS rebinding.

A local `llmc serve` with no API key is open to any page its user visits, unless the browser stops that page:
- a form POST or a `text/plain` fetch needs no CORS preflight, so it reaches the server whatever the page's
  origin: the server parses only bodies sent as `Content-Type: application/json` (protocol.py; 415 otherwise),
  and a JSON POST from another origin needs a preflight, which a server without CORS fails;
- a DNS-rebinding page (evil.example.com, re-resolved to 127.0.0.1) is same-origin with the server, so it can
  read the answers: its requests carry `Host: evil.example.com`, so the server answers only the Host names it
  is served under (`SitePolicy.allowed_hosts`, from the bound address: `hosts_for`; 400 otherwise);
- CORS is off unless origins are named (`allowed_origins`, as vLLM's --allowed-origins): then starlette's
  CORSMiddleware answers preflights for those origins, methods and headers.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from llmc.runtime.server.errors import error_response

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")


@dataclasses.dataclass(frozen=True)
class SitePolicy:
    """The Host names the server answers and the origins CORS lets in; the default lets any Host in and no origin.

    allowed_hosts: names (compared without the port, case-insensitively), `*.example.com` for its subdomains,
    or None for any Host. ip_hosts: any IP address as Host as well (a rebinding page cannot send one; for a
    server bound to every interface, reached by its addresses).
    """

    allowed_hosts: tuple[str, ...] | None = None
    ip_hosts: bool = False
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")

    def host_allowed(self, host: str | None) -> bool:
        if self.allowed_hosts is None or host is None:  # no Host (HTTP/1.0) is not a browser's request
            return True
        name = _host_name(host)
        if name is None:
            return False
        if self.ip_hosts and _is_ip(name):
            return True
        return any(name == h or (h.startswith("*.") and name.endswith(h[1:])) for h in self.allowed_hosts)


def hosts_for(bind_host: str, extra: Sequence[str] = (), *, any_host: bool = False) -> SitePolicy:
    """The Host check for a server bound to `bind_host`: that address or name; the localhost names when it is
    loopback; when it is every interface (0.0.0.0, ::), the localhost names, this machine's names and any IP
    address. extra: names the user adds (`--allowed-hosts`; `*` for any Host, as any_host)."""
    if any_host or "*" in extra:
        return SitePolicy(allowed_hosts=None)
    names = {h.strip().lower().rstrip(".") for h in extra if h.strip()}
    bind = bind_host.strip("[]").lower()
    if bind in WILDCARD_ADDRESSES:
        names |= {*LOCAL_NAMES, socket.gethostname().lower(), socket.getfqdn().lower()}
        return SitePolicy(allowed_hosts=tuple(sorted(names)), ip_hosts=True)
    names.add(bind)
    if bind == "localhost" or (_is_ip(bind) and ipaddress.ip_address(bind).is_loopback):
        names |= set(LOCAL_NAMES)
    return SitePolicy(allowed_hosts=tuple(sorted(names)))


def _host_name(host: str) -> str | None:
    """The name in a Host header (`name`, `name:port`, `[v6]:port`), lowercased; None when it is not one."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        return name if sep and (not rest or rest[1:].isdigit() and rest[0] == ":") else None
    name, _, port = host.partition(":")
    return name.rstrip(".") if name and (not port or port.isdigit()) else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _HostCheck:
    """ASGI middleware: a request whose Host the policy does not allow gets a 400, before anything else runs."""

    def __init__(self, app, policy: SitePolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.policy.host_allowed(host):
                shown = host if len(host) <= 100 else host[:100] + "..."
                response = error_response(
                    f"this server does not answer to Host {shown!r}: a DNS-rebinding page sends its own name; "
                    "the server's operator can allow it with `llmc serve --allowed-hosts NAME`",
                    400,
                    code="invalid_host",
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_site_policy(app: FastAPI, policy: SitePolicy) -> None:
    """CORS for the policy's origins (none: no CORS at all), and outside it the Host check."""
    if policy.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(policy.allowed_origins),
            allow_methods=list(policy.allowed_methods),
            allow_headers=list(policy.allowed_headers),
        )
    if policy.allowed_hosts is not None:
        app.add_middleware(_HostCheck, policy=policy)  # added last: the outermost, so it runs first
