"""Which prefill servers a decode server may contact: its own configuration, never a client's.

    peers = PrefillPeers.parse("127.0.0.1:8998, 10.0.0.7:8998")   # ValueError if malformed
    peers.refusal("10.0.0.9", 8998)   # None: allowed; else (the field to blame, why)

SGLang's router names the prefill server of each request in its body (bootstrap_host,
bootstrap_port), so any client of a decode server could otherwise make it open connections
to any host and port. A decode server only ever contacts the peers listed in its
`disaggregation_prefill_peers` option, compared as written (a host name is not resolved:
"localhost" and "127.0.0.1" are different entries), case-insensitively, IPv6 with or
without brackets.
"""

from __future__ import annotations

from dataclasses import dataclass

Peer = tuple[str, int]  # (host, port), the host normalised by `host_key`


def host_key(host: str) -> str:
    """The form hosts are compared in: lower case, an IPv6 address without its brackets."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


@dataclass(frozen=True)
class PrefillPeers:
    peers: frozenset[Peer]

    @staticmethod
    def parse(text: str) -> PrefillPeers:
        """Comma-separated host:port entries ("[::1]:8998" for IPv6); at least one."""
        peers = set()
        for entry in (part.strip() for part in text.split(",")):
            if not entry:
                continue
            host, sep, port_text = entry.rpartition(":")
            host = host_key(host)
            if not sep or not host or not port_text.isascii() or not port_text.isdigit():
                raise ValueError(f"prefill peer {entry!r} is not host:port")
            if ":" in host and not entry.startswith("["):
                raise ValueError(f"prefill peer {entry!r}: write an IPv6 address as [addr]:port")
            port = int(port_text)
            if not 0 < port < 65536:
                raise ValueError(f"prefill peer {entry!r}: the port must be in [1, 65535]")
            peers.add((host, port))
        if not peers:
            raise ValueError("disaggregation_prefill_peers must name at least one host:port")
        return PrefillPeers(frozenset(peers))

    def refusal(self, host: str, port: int) -> tuple[str, str] | None:
        """None when (host, port) is a listed peer; else the field to name and why not."""
        key = host_key(host)
        if (key, port) in self.peers:
            return None
        field = "bootstrap_port" if any(h == key for h, _ in self.peers) else "bootstrap_host"
        shown = f"[{host}]" if ":" in key else host
        return field, (
            f"bootstrap_host:bootstrap_port {shown[:100]}:{port} is not a prefill server this "
            "server may contact: list it in the decode server's disaggregation_prefill_peers"
        )
