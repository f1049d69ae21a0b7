"""The names the server answers to: the `Host` check that stops DNS rebinding (api/http/guard.py).

A page on http://evil.example:30000 can have its name re-pointed at 127.0.0.1 after it loaded.
To the browser its fetch() calls are then same-origin (`Origin: http://evil.example:30000`,
`Host: evil.example:30000`), so comparing Origin with Host proves nothing: the Host header is
what the browser thinks it is talking to, and that is what must be checked. A Host is accepted
when it is

    an IP literal (127.0.0.1, 10.0.0.5, [::1], ...)   always: a browser sends one only when it
                                                      connected to that address itself, and
                                                      rebinding needs a name (as Vite does)
    localhost                                         always: the loopback's own name (as
                                                      Jupyter; ".localhost" in --allowed-hosts
                                                      adds the names under it, RFC 6761)
    the name the server is bound to (--host a.lan)    the operator serves it by that name
    an --allowed-hosts entry                          "api.example.com": that name; ".example.com":
                                                      it and every name under it; "*": any Host
    absent (HTTP/1.0)                                 no browser sends a request without one

and refused (403, code host_not_allowed) otherwise. Bound to 0.0.0.0 or :: the server is reached
by any of the machine's addresses, and every IP literal passes; a name it is reached by (a DNS
name, a Kubernetes service) must be listed, as Vite asks. The port is ignored; names compare
without case and without a trailing dot.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

ANY_HOST = "*"
LOOPBACK_NAME = "localhost"
# a DNS name: dot-separated labels of letters, digits, '-' and '_' (no scheme, port or path)
_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str | None:
    """'Evil.Example.:8080' -> 'evil.example'; '[::1]:80' -> '::1'; None for what is neither
    an IP literal nor a name, with an optional port."""
    text = header.strip().lower()
    if text.startswith("["):  # an IPv6 literal, then maybe ":port"
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or ":" not in inside or not is_ip(inside) or not _port(rest):
            return None
        return inside
    name, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    name = name.removesuffix(".")
    return name if is_ip(name) or _NAME.fullmatch(name) else None


def _port(rest: str) -> bool:
    return rest == "" or (rest.startswith(":") and rest[1:].isdigit())


def parse_hosts(entries: Iterable[str]) -> frozenset[str]:
    """--allowed-hosts entries, normalised: "*", a name, or ".name" (it and what is under it);
    ValueError for anything else (a scheme, a port, a path)."""
    allowed = set()
    for entry in entries:
        text = entry.strip().lower()
        if text == ANY_HOST:
            allowed.add(text)
            continue
        bare = text.removeprefix(".").removesuffix(".")
        if not (is_ip(bare) or _NAME.fullmatch(bare)):
            raise ValueError(
                f"allowed host {entry!r} is not '*', a host name (api.example.com) or a "
                "domain (.example.com): give no scheme, port or path"
            )
        allowed.add(("." if text.startswith(".") else "") + bare)
    return frozenset(allowed)


class HostCheck:
    """Whether a request's Host header names this server (the table above)."""

    def __init__(self, allowed_hosts: Iterable[str], bound_host: str) -> None:
        self.allowed = parse_hosts(allowed_hosts)
        self.any = ANY_HOST in self.allowed
        bound = bound_host.strip().lower().removesuffix(".")
        if bound and not is_ip(bound) and _NAME.fullmatch(bound):
            self.allowed |= {bound}
        self.domains = tuple(entry for entry in self.allowed if entry.startswith("."))

    def allows(self, header: str | None) -> bool:
        if self.any or header is None or not header.strip():
            return True
        name = host_name(header)
        if name is None:
            return False
        if is_ip(name) or name == LOOPBACK_NAME:
            return True
        return name in self.allowed or any(
            name == domain[1:] or name.endswith(domain) for domain in self.domains
        )
