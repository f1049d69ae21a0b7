"""Where a step's device work is queued and how its results come back, without waiting.

On CUDA a step runs on a dedicated compute stream: table writes, inputs, forward and sampling,
in launch order, so a row written for batch N+1 is never read by batch N's forward
(docs/architecture.md, "Lifecycle laws", law 3, by stream order). Results are copied into
pinned host memory on a second stream after an event, and only the thread that collects them
waits. On CPU every operation has finished when it returns, so the same calls are plain
copies and the waits are no-ops.

Host-to-device copies go through `to_device` (kernels/device_copy.py): a plain
`torch.tensor(..., device="cuda")` synchronizes the stream and would undo the overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class HostResult:
    """Tensors on their way to pinned host memory; `wait()` returns them once they are there."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], done: torch.cuda.Event | None) -> None:
        self._tensors = tensors
        self._done = done

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._done is not None:
            self._done.synchronize()  # releases the GIL while it waits
        return self._tensors


class StepStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute: torch.cuda.Stream | None = None
        self.copy: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self.compute = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Queue everything in the block on the compute stream (the current thread's only)."""
        if self.compute is None:
            yield
            return
        with torch.cuda.stream(self.compute):
            yield

    def to_host(self, tensors: tuple[torch.Tensor, ...]) -> HostResult:
        """Start copying device tensors (queued on the compute stream) to pinned host memory."""
        if self.compute is None or self.copy is None:
            return HostResult(tuple(t.cpu() for t in tensors), None)
        ready = torch.cuda.Event()
        ready.record(self.compute)
        hosts = []
        with torch.cuda.stream(self.copy):
            self.copy.wait_event(ready)
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.copy)  # not reused by the compute stream before the copy
                hosts.append(host)
        done = torch.cuda.Event()
        done.record(self.copy)
        return HostResult(tuple(hosts), done)

    def synchronize(self) -> None:
        """Wait until everything queued so far, on any stream, has run. Our streams do not
        wait for the default one by themselves, so this comes after uploading weights and
        allocating the KV pool there, and before replacing weights in place."""
        if self.compute is not None:
            torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        """Give the CUDA allocator's cached blocks back to the device (after a release of
        memory, so another process, a colocated trainer, can take it). Nothing on the CPU."""
        if self.compute is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
