"""Where a server's KV lives, as addresses another server can write into.

Each layer's K and V are one tensor of [num_slots, num_kv_heads, head_dim] (models/
kv_pool.py), a page is `page_size` consecutive slots, so page p of layer l starts at
`k_addrs[l] + p * page_bytes`::

    layer l, K:  [ page 0 | page 1 | page 2 | ... ]      page_bytes each
                 ^ k_addrs[l]

Two servers can move pages only when everything but the addresses agrees (`mismatch`).
"""

from __future__ import annotations

import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # torch's name, e.g. "torch.float32"
    page_bytes: int
    num_pages: int
    k_addrs: tuple[int, ...]  # per layer, in layer order across pipeline stages
    v_addrs: tuple[int, ...]

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every K and V tensor: what a backend registers."""
        size = self.page_bytes * self.num_pages
        return [(addr, size) for addr in (*self.k_addrs, *self.v_addrs)]

    def mismatch(self, other: KVLayout) -> str | None:
        """Why pages of `other` cannot be written into this layout's (None: they can)."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV layouts differ: {name} {mine} here, {theirs} on the peer"
        return None


def page_copies(
    src: KVLayout, src_pages: list[int], dst: KVLayout, dst_pages: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy src_pages[i] of every
    layer's K and V onto dst_pages[i]; runs of consecutive pages on both sides are merged."""
    assert len(src_pages) == len(dst_pages)
    runs: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    size = src.page_bytes
    srcs, dsts, lengths = [], [], []
    for src_bases, dst_bases in ((src.k_addrs, dst.k_addrs), (src.v_addrs, dst.v_addrs)):
        for src_base, dst_base in zip(src_bases, dst_bases, strict=True):
            for s, d, n in runs:
                srcs.append(src_base + s * size)
                dsts.append(dst_base + d * size)
                lengths.append(n * size)
    return srcs, dsts, lengths
