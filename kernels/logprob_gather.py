"""What a request asks of a distribution at one position, gathered on the device: the chosen
token's logprob (and its rank), the top k alternatives, the logprobs of the ids it lists
(token_ids_logprob). Output tokens take it from the step's sampled logits (`logprob_columns`);
a prompt's positions (SamplingParams.logprob_start_len) from the head run on slices of the
batch's hidden states (`sliced_logprobs`), so a long prompt's logits [T, V] are never held
whole: at most `SLICE_ELEMENTS` logits (and their log_softmax) at a time.

Every logprob is the model's raw one: log_softmax of the head's float32 logits, before
penalties, biases and temperature (params.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shoal.kernels.device_copy import to_device

SLICE_ELEMENTS = 1 << 24  # logits per slice of prompt positions: 64 MiB of float32

# One position's answers, batched: chosen [B] float32, rank [B] int64 (1: the most likely),
# top values [B, k] float32 and ids [B, k] int64 (most likely first), listed [B, L] float32.
LogprobColumns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def listed_ids(lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Each row's listed ids as one int64 matrix [B, L], L the longest list; shorter rows are
    padded with id 0, and their extra columns are dropped on the host."""
    width = max((len(ids) for ids in lists), default=0)
    flat = [t for ids in lists for t in (*ids, *(0,) * (width - len(ids)))]
    return to_device(flat, torch.int64, device).view(len(lists), width)


def logprob_columns(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int, listed: torch.Tensor
) -> LogprobColumns:
    """From logits [B, V]: each row's answers for its target token, top_k and listed ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.long().unsqueeze(1))
    rank = (logprobs > chosen).sum(dim=1) + 1
    if top_k > 0:
        values, ids = logprobs.topk(top_k, dim=-1)
    else:
        values, ids = logprobs[:, :0], torch.zeros_like(logprobs[:, :0], dtype=torch.int64)
    return chosen.squeeze(1), rank, values, ids.long(), logprobs.gather(1, listed)


def sliced_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    index: torch.Tensor,
    targets: torch.Tensor,
    top_k: int,
    listed: torch.Tensor,
    vocab_size: int,
) -> LogprobColumns:
    """`logprob_columns` of the positions `index` [M] of a batch, `head(places)` giving their
    float32 logits, a slice of at most SLICE_ELEMENTS logits at a time."""
    rows = max(1, SLICE_ELEMENTS // vocab_size)
    parts = [
        logprob_columns(
            head(index[lo : lo + rows]), targets[lo : lo + rows], top_k, listed[lo : lo + rows]
        )
        for lo in range(0, int(index.shape[0]), rows)
    ]
    if len(parts) == 1:
        return parts[0]
    chosen, rank, values, ids, listed_values = zip(*parts, strict=True)
    return (
        torch.cat(chosen),
        torch.cat(rank),
        torch.cat(values),
        torch.cat(ids),
        torch.cat(listed_values),
    )
