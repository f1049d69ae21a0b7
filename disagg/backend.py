"""A transfer backend moves pages from this server's KV into a peer's, given addresses.

    backend.register(layout)                           # once, at start: the KV tensors
    backend.endpoint                                   # what a peer writes to
    backend.write(peer, srcs, dsts, lengths) -> None | str   # blocking; str: why it failed
    backend.close()

`write` is called off the event loop (a worker thread) and returns once every byte landed,
or failed: after it returns nothing more of that call can land. Implementations: Mooncake's
transfer engine (disagg/mooncake.py) and `LocalBackend`, an in-process copy between servers
that share one `LocalFabric` (tests, and both roles in one process).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Protocol

from shoal.disagg.layout import KVLayout


class TransferBackend(Protocol):
    name: str

    @property
    def endpoint(self) -> str: ...

    def register(self, layout: KVLayout) -> None: ...

    def write(
        self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]
    ) -> str | None: ...

    def close(self) -> None: ...


class LocalFabric:
    """The local endpoints of one process, and the tests' seam on their writes."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.endpoints: dict[str, list[tuple[int, int]]] = {}
        self.names = itertools.count()
        self.reject: str | None = None  # the next write fails with this
        self.held = False  # writes wait until released
        self.writing = 0  # writes in progress (held ones included)
        self.bytes_written = 0

    def hold_writes(self) -> None:
        with self.lock:
            self.held = True

    def release_writes(self) -> None:
        with self.lock:
            self.held = False
            self.lock.notify_all()

    def reject_next_write(self, reason: str) -> None:
        with self.lock:
            self.reject = reason

    def wait_writing(self, count: int, timeout_s: float = 10.0) -> None:
        """Block until `count` writes are in progress (a test holding writes)."""
        with self.lock:
            if not self.lock.wait_for(lambda: self.writing >= count, timeout_s):
                raise TimeoutError(f"{count} writes did not start in {timeout_s}s")


def _inside(regions: list[tuple[int, int]], addr: int, length: int) -> bool:
    return any(base <= addr and addr + length <= base + size for base, size in regions)


class LocalBackend:
    name = "local"

    def __init__(self, fabric: LocalFabric) -> None:
        self.fabric = fabric
        self._endpoint = f"local-{next(fabric.names)}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, layout: KVLayout) -> None:
        with self.fabric.lock:
            self.fabric.endpoints[self._endpoint] = layout.regions()

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> str | None:
        fabric = self.fabric
        with fabric.lock:
            fabric.writing += 1
            fabric.lock.notify_all()
            try:
                fabric.lock.wait_for(lambda: not fabric.held)
                error = self._check(peer, srcs, dsts, lengths)
                if error is not None:
                    return error
                for src, dst, length in zip(srcs, dsts, lengths, strict=True):
                    ctypes.memmove(dst, src, length)
                fabric.bytes_written += sum(lengths)
                return None
            finally:
                fabric.writing -= 1

    def _check(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> str | None:
        fabric = self.fabric
        if fabric.reject is not None:
            reason, fabric.reject = fabric.reject, None
            return reason
        if peer not in fabric.endpoints:
            return f"transfer peer {peer} is gone"
        mine, theirs = fabric.endpoints.get(self._endpoint, []), fabric.endpoints[peer]
        for src, dst, length in zip(srcs, dsts, lengths, strict=True):
            if not _inside(mine, src, length) or not _inside(theirs, dst, length):
                return f"write rejected: {length} bytes at {dst:#x} lie outside {peer}'s KV"
        return None

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.endpoints.pop(self._endpoint, None)
