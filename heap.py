"""Give the host memory freed by a weight load back to the operating system.

A weight update reads the checkpoint (one copy of the weights) and builds the new weights beside
the serving ones (a second), then frees the old and the read copy. glibc's malloc keeps what
was freed: its mmap threshold rises each time a large mmapped block is freed, so the next
loads' tensors come from the heap, and a freed heap is kept for reuse rather than returned.
Measured on SmolLM2 (float32, 538 MB of weights) over ten updates of the same checkpoint: RSS
3008 MB at start, 4229 after the first update, 4803 after the tenth. `trim_host_heap` after
each load asks malloc to return every free page of every arena (`malloc_trim(0)`); with it
RSS stays at 2358-2380 MB across the ten (bench/README.md, "Memory after weight updates").

It is called where a burst of large frees ends (after a start's load, after each weight
update), never per step: a trim walks the arenas (milliseconds), and the steps' own
allocations reuse the heap as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def trim_host_heap() -> bool:
    """Return the allocator's free pages to the OS; False where the C library has no
    malloc_trim (musl, macOS), which is harmless: those allocators return memory their own
    way."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
