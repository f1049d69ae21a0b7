"""What one layer's attention reads in the torch reference: the step's decode groups and its
multi-token sequences (`Views`), how decodes of mixed lengths are grouped, and those views
trimmed to the pages a sliding window reaches.

A trimmed view never names a page wholly before the window (it may have been freed and reused
by another request: cache/kv.py's trim); keys before the window on its first page are masked.
Built once per step and window by `AttentionMetadata.attend` (attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class DecodePages:
    """A group of a step's decode sequences, attended page by page (padded to its longest)."""

    token_index: torch.Tensor  # [B_dec] which of the T tokens each decode is
    page_ids: torch.Tensor  # [B_dec, P_max] each sequence's pages (past its last: any page)
    key_mask: torch.Tensor  # [B_dec, 1, 1, P_max * page_size] bool: key is one of its tokens
    seq_lens: torch.Tensor  # [B_dec] int64


@dataclass(frozen=True)
class ExtendSeq:
    """One sequence bringing more than one new token: its queries attend causally to the keys
    from position key_start (0, or the first page a window reaches) to seq_len."""

    token_start: int  # its first token among the T
    num_new: int
    seq_len: int  # cached prefix + new tokens
    page_ids: torch.Tensor  # [ceil(seq_len / page_size) - key_start / page_size]
    mask: torch.Tensor | None  # [num_new, seq_len - key_start] bool; None: plain causal
    key_start: int = 0  # a multiple of page_size


# A decode group's padding (pages gathered beyond its sequences' own) may reach this share of
# its own pages, or this many pages, before the longest sequences get a group of their own:
# each group is one more gather and SDPA call per layer, worth it only for much padding.
MAX_PADDING_SHARE = 0.25
MAX_PADDING_PAGES = 32


def length_groups(ids: list[int], seq_lens: list[int], page_size: int) -> list[list[int]]:
    """Split decode sequences, longest first, into groups whose padding stays small: batches
    of mixed lengths gather far fewer pages than padding every sequence to the longest."""
    groups: list[list[int]] = []
    own_pages = 0
    for i in sorted(ids, key=lambda i: -seq_lens[i]):
        pages = -(-seq_lens[i] // page_size)
        if groups:
            group = groups[-1]
            longest = -(-seq_lens[group[0]] // page_size)
            padding = longest * (len(group) + 1) - (own_pages + pages)
            if padding <= max(MAX_PADDING_SHARE * (own_pages + pages), MAX_PADDING_PAGES):
                group.append(i)
                own_pages += pages
                continue
        groups.append([i])
        own_pages = pages
    return groups


class Views(NamedTuple):
    """What a layer attends through: the decode groups and extend sequences."""

    decodes: tuple[DecodePages, ...]
    extends: tuple[ExtendSeq, ...]


def window_views(views: Views, window: int, page_size: int) -> Views:
    """The decode groups and extends trimmed to the pages a window of `window` keys reaches:
    pages wholly before it are neither gathered nor read (they may have been freed and
    reused), keys before it on its first page are masked."""
    decodes = tuple(window_decodes(dec, window, page_size) for dec in views.decodes)
    extends = tuple(window_extend(ext, window, page_size) for ext in views.extends)
    return Views(decodes, extends)


def window_decodes(dec: DecodePages, window: int, page_size: int) -> DecodePages:
    """Each sequence's pages from the one holding key seq_len - window on, padded to the
    group's most; its mask keeps keys seq_len - window .. seq_len - 1."""
    lens, device = dec.seq_lens, dec.seq_lens.device
    first_page = (lens - window).clamp(min=0) // page_size
    num_pages = -(-lens // page_size) - first_page
    page_index = first_page[:, None] + torch.arange(int(num_pages.max()), device=device)
    last = dec.page_ids.shape[1] - 1
    page_ids = dec.page_ids.gather(1, page_index.clamp(max=last))  # past its last: any
    offsets = torch.arange(page_size, device=device)
    key_pos = (page_index[:, :, None] * page_size + offsets).flatten(1)
    key_mask = (key_pos < lens[:, None]) & (key_pos >= lens[:, None] - window)
    return DecodePages(dec.token_index, page_ids, key_mask[:, None, None], lens)


def window_extend(ext: ExtendSeq, window: int, page_size: int) -> ExtendSeq:
    """The pages from the one holding the first new token's first key on; new token p sees
    keys p - window < k <= p."""
    prefix = ext.seq_len - ext.num_new
    first_page = max(0, prefix - window + 1) // page_size
    key_start = first_page * page_size
    device = ext.page_ids.device
    query_pos = torch.arange(prefix, ext.seq_len, device=device)[:, None]
    key_pos = torch.arange(key_start, ext.seq_len, device=device)[None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
    page_ids = ext.page_ids[first_page:]
    return ExtendSeq(ext.token_start, ext.num_new, ext.seq_len, page_ids, mask, key_start)
