"""Mooncake's transfer engine as a TransferBackend (disagg/backend.py).

`pip install mooncake-transfer-engine-non-cuda` (CPU; the CUDA build where there is a GPU),
which needs the Debian package libibverbs1 even without RDMA. It runs peer to peer
("P2PHANDSHAKE": no metadata server); a peer is named "host:rpc_port". Its ports listen on
every interface whatever host it is given (docs/disaggregation.md says so).
"""

from __future__ import annotations

from typing import Any

from shoal.disagg.layout import KVLayout


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the package, or libibverbs1 under it
            raise ValueError(
                "disaggregation_transfer_backend mooncake needs the package "
                "mooncake-transfer-engine-non-cuda (and the system library libibverbs1): "
                f"{exc}"
            ) from exc
        self.engine: Any = TransferEngine()
        status = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if status != 0:
            raise ValueError(f"Mooncake's transfer engine did not start on {host} ({status})")
        self._endpoint = f"{host}:{self.engine.get_rpc_port()}"
        self.regions: list[tuple[int, int]] = []

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, layout: KVLayout) -> None:
        self.regions = layout.regions()
        addrs = [addr for addr, _ in self.regions]
        sizes = [size for _, size in self.regions]
        status = self.engine.batch_register_memory(addrs, sizes)
        if status != 0:
            raise ValueError(f"Mooncake could not register the KV pool ({status})")

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> str | None:
        status = self.engine.batch_transfer_sync_write(peer, srcs, dsts, lengths)
        if status != 0:
            return f"Mooncake's write to {peer} failed ({status}: a dead peer or a rejected write)"
        return None

    def close(self) -> None:
        if self.regions:
            self.engine.batch_unregister_memory([addr for addr, _ in self.regions])
            self.regions = []
