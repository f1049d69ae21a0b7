"""Mooncake's transfer engine as a TransferBackend (disagg/backend.py).

`pip install mooncake-transfer-engine-non-cuda` (CPU; the CUDA build where there is a GPU),
which needs the Debian package libibverbs1 even without RDMA. It runs peer to peer
("P2PHANDSHAKE": no metadata server); a peer is named "host:rpc_port". Its ports listen on
every interface whatever host it is given (docs/disaggregation.md says so).

What its Python API does on this kind of machine, measured (docs/disaggregation.md):
- a blocking `batch_transfer_sync_write` spins a whole core while it waits, so a write here
  submits each slice (`transfer_submit_write`) and polls (`transfer_check_status`: 0 pending,
  1 done, negative failed; the id is freed once it is not 0) with short sleeps;
- more than about 2048 slices in flight to one peer fail, so at most MAX_IN_FLIGHT are;
- a write to a peer that died returns -1 within a second; to a peer that hangs, after
  MC_TRANSFER_TIMEOUT (30 s by default), and then its bytes may still land if the peer
  resumes: Mooncake cannot take a write back.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from shoal.disagg.layout import KVLayout

MAX_IN_FLIGHT = 512  # slices submitted and not yet done, to one peer
POLL_S = 0.0005


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # else every transfer logs to stderr
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
        """Every slice submitted, at most MAX_IN_FLIGHT at once, and polled until each is
        over; after a failure nothing more is submitted, but this returns only once none of
        those submitted is pending."""
        todo = deque(zip(srcs, dsts, lengths, strict=True))
        pending: list[int] = []
        error: str | None = None
        while todo or pending:
            while todo and len(pending) < MAX_IN_FLIGHT and error is None:
                src, dst, length = todo.popleft()
                batch = self.engine.transfer_submit_write(peer, src, dst, length)
                if batch < 0:
                    error = f"Mooncake refused a write to {peer} ({batch})"
                else:
                    pending.append(batch)
            if error is not None:
                todo.clear()
            still = []
            for batch in pending:
                status = self.engine.transfer_check_status(batch)
                if status == 0:
                    still.append(batch)
                elif status != 1 and error is None:
                    error = (
                        f"Mooncake's write to {peer} failed ({status}: a dead peer, a "
                        "timeout or a write outside its registered memory)"
                    )
            pending = still
            if pending:
                time.sleep(POLL_S)
        return error

    def close(self) -> None:
        if self.regions:
            self.engine.batch_unregister_memory([addr for addr, _ in self.regions])
            self.regions = []
