"""The compiled CPU kernels' views of a step (cpu_kernels.py): all of its decodes for
`paged_decode`, all of its multi-token chunks for `paged_extend`, each one call a layer that
reads the pages in place. Built with the rest of a step's attention metadata (attention.py's
`build_metadata`) from the rows' page ids [B, max_pages], each sequence's first token in the
step's flat batch, its new tokens and its length (prefix + new)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.cpu_kernels import DecodeKernel, ExtendKernel


@dataclass(frozen=True)
class KernelDecodes:
    """All of a step's decode sequences, for a compiled kernel reading the pages in place."""

    kernel: DecodeKernel
    token_index: torch.Tensor  # [B_dec] int64: which of the T tokens each decode is
    page_ids: torch.Tensor  # [B_dec, P_max] int64: each sequence's pages (past its last: any)
    seq_lens: torch.Tensor  # [B_dec] int64

    @staticmethod
    def of(
        kernel: DecodeKernel, ids: list[int], pages: torch.Tensor, first_token: torch.Tensor,
        seq_lens: list[int], page_size: int,
    ) -> KernelDecodes:  # fmt: skip
        """The sequences `ids` of the step (its decodes)."""
        index, page_ids, lens = _sequences(ids, pages, seq_lens, page_size)
        return KernelDecodes(kernel, first_token[index], page_ids, lens)


@dataclass(frozen=True)
class KernelExtends:
    """All of a step's multi-token chunks, for the compiled extend kernel (whole sequences: a
    layer with a window or a soft cap takes the gathered views instead)."""

    kernel: ExtendKernel
    page_ids: torch.Tensor  # [E, P_max] int64
    seq_lens: torch.Tensor  # [E] int64: prefix + new tokens
    num_new: torch.Tensor  # [E] int64
    token_start: torch.Tensor  # [E] int64: the row of the chunk's first new token

    @staticmethod
    def of(
        kernel: ExtendKernel, ids: list[int], pages: torch.Tensor, first_token: torch.Tensor,
        new_counts: torch.Tensor, seq_lens: list[int], page_size: int,
    ) -> KernelExtends:  # fmt: skip
        """The sequences `ids` of the step (its chunks)."""
        index, page_ids, lens = _sequences(ids, pages, seq_lens, page_size)
        return KernelExtends(kernel, page_ids, lens, new_counts[index], first_token[index])


def _sequences(
    ids: list[int], pages: torch.Tensor, seq_lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences `ids` of a step: their index, their pages [len(ids), P_max] (as many as
    the longest needs) and their lengths."""
    index = torch.tensor(ids, dtype=torch.int64, device=pages.device)
    max_pages = -(-max(seq_lens[i] for i in ids) // page_size)
    lens = torch.tensor([seq_lens[i] for i in ids], dtype=torch.int64, device=pages.device)
    return index, pages[index, :max_pages].contiguous(), lens
