"""The KV cache's host memory in transparent huge pages (Linux), where it is big enough.

A decode step on the CPU reads each sequence's K and V rows from pages the cache manager put
anywhere in the pool, so after a while of serving its reads jump across the whole pool and each
jump can miss the TLB (a 4 KB page holds about ten tokens' K rows of SmolLM2 in bfloat16). With
the pool in 2 MB pages, a few hundred entries cover it all. Linux gives anonymous
memory huge pages only where it was asked to (`madvise(MADV_HUGEPAGE)`) when the system's
setting is `madvise`, the common default, and torch's CPU allocator asks only when
`THP_MEM_ALLOC_ENABLE=1` was set before its first allocation; so the pool asks itself:

    k = zeros((slots, kv_heads, head_dim), torch.bfloat16)   # models/kv_pool.py

Where the advice does not apply (not Linux, under 2 MB) the tensor is torch.zeros' own; where
the kernel ignores it (the setting `never`) or refuses it (built without huge pages), the same
memory in small pages. Either way it is written once here, so the pages are there before a step
needs them (a first write later would stall a step on the kernel's fault, or its compaction).
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE = 2 * 1024 * 1024


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros, in memory advised as huge pages when it is 2 MB or more."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(shape, dtype=dtype)
    # private anonymous memory (mmap's default for no file is shared, /dev/zero's shmem, which
    # the kernel's `shmem_enabled` governs instead), a huge page more than asked for, so that
    # the tensor can start on a huge page's boundary (its last part, under 2 MB, stays in small
    # pages, and the untouched rest costs nothing); the tensor holds the mapping while it lives
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(OSError):  # a kernel without huge pages refuses: small pages then
        region.madvise(advice)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    tensor = whole[start : start + nbytes].view(dtype).view(shape)
    return tensor.zero_()  # every page faulted in now, not in a step
