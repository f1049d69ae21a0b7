"""A launch's request-slot table writes applied as one scatter per table.

`RowWriteMsg(row, start, pages)` means table[row, start : start + len(pages)] = pages, and the
writes of a launch apply in order, so where two write the same entry the later one wins. As a
scatter's order among equal indices is unspecified, only each entry's last write is scattered.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from shoal.actors.executor_messages import RowWriteMsg
from shoal.kernels.device_copy import array_to_device


def write_tables(tables: Sequence[torch.Tensor], writes: Sequence[RowWriteMsg]) -> None:
    """Apply `writes` to every table (each stage's copy, all of one shape), in one host-to-device
    copy and one index_put_ each, on the current stream."""
    lengths = [len(w.pages) for w in writes]
    total = sum(lengths)
    if total == 0:
        return
    rows = np.repeat(np.fromiter((w.row for w in writes), np.int64, len(writes)), lengths)
    first = np.repeat(np.fromiter((w.start for w in writes), np.int64, len(writes)), lengths)
    # Each entry's offset within its write: 0 .. n - 1 per write.
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = first + offsets
    pages = np.fromiter(itertools.chain.from_iterable(w.pages for w in writes), np.int64, total)
    keys = rows * tables[0].shape[1] + cols
    _, last_reversed = np.unique(keys[::-1], return_index=True)  # each key's last write
    keep = total - 1 - last_reversed
    host = np.concatenate((rows[keep], cols[keep], pages[keep]))
    packed = array_to_device(host, tables[0].device)
    for table in tables:
        row_index, col_index, values = packed.to(table.device).view(3, -1)
        table.index_put_((row_index, col_index), values)
