"""Who may drive `llmem serve`: a request whose `Host` is the address served (a page on another site that resolves
its own name to this address, DNS rebinding, is refused), or a name allowed with --allow-host (a reverse proxy's);
work only on POST, with a JSON body, from the page's own origin (a form or script on another site cannot post
here: browsers send Origin and Sec-Fetch-Site, and a cross-site JSON post needs a CORS answer this server never
gives); bodies at most MAX_REQUEST_BYTES. Each refusal is one line of JSON, as the app's others."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmem.cli.serve_query import MAX_REQUEST_BYTES

LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class Hosts:
    """The Host values accepted: the served address (any IP literal when it listens on every interface), localhost
    when it listens on loopback, on the served port; and the names given with --allow-host, on any port."""
    address: str                        # the IP the server listens on ("0.0.0.0", "::", "127.0.0.1", ...)
    port: int
    allowed: tuple[str, ...] = ()       # --allow-host names (lower case)

    def accepts(self, host: str) -> bool:
        name, port = _split_host(host)
        if name is None:
            return False
        if name in self.allowed:
            return True
        if port != self.port and not (port is None and self.port == 80):
            return False
        served = ipaddress.ip_address(self.address) if _is_ip(self.address) else None
        if served is not None and served.is_unspecified:
            return _is_ip(name)
        if name in LOOPBACK_NAMES:
            return served is None or served.is_loopback
        return _is_ip(name) and served is not None and ipaddress.ip_address(name) == served


def _split_host(host: str) -> tuple[str | None, int | None]:
    """('name', port) from a Host header ('[::1]:8000', 'localhost:8000', 'example.org'); (None, None) if bad."""
    try:
        parts = urlsplit("//" + host.strip())
        return (parts.hostname or "").lower() or None, parts.port
    except ValueError:
        return None, None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _refusal(status: int, text: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": text}).encode()


def check(scope: dict, hosts: Hosts) -> tuple[int, bytes] | None:
    """A refusal (status, JSON body) for a request this server must not answer, or None."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    host = headers.get("host", "")
    if not hosts.accepts(host):
        return _refusal(421, f"Host {host[:80]!r} is not this server's address: open the page by the address "
                             "llmem serve printed (behind a proxy: start it with --allow-host NAME)")
    if scope["method"] not in ("GET", "HEAD"):
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
            return _refusal(403, f"a request from {origin[:80]!r}, another site: only this server's page may ask "
                                 "it for work")
        if headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return _refusal(403, "a request from another site: only this server's page may ask it for work")
        if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return _refusal(415, "post the query as JSON (Content-Type: application/json), as the page does")
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            return _refusal(413, f"the request is {length[:20]} bytes; uploads fit in {MAX_REQUEST_BYTES:,}: "
                                 "upload the config files themselves")
    return None


class Guard:
    """ASGI middleware: check() before the app sees the request."""

    def __init__(self, app, hosts: Hosts):
        self.app = app
        self.hosts = hosts
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = check(scope, self.hosts)
            if refused is not None:
                status, body = refused
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
