"""Batched per-request sampling: one next token per row of a [B, V] logits tensor.

Pipeline (a row pays only for the stages its SamplingParams turn on):

    logits ─ penalties ─ row constraints ─ min_new_tokens mask ─┬─ greedy rows:  argmax
                                                                └─ sampled rows: / T ─ softmax
                                           ─ top-k ─ top-p ─ min-p ─ inverse CDF at one uniform

`sample(logits, rows)` takes each row's view (`SamplingRow`); the edits that need a row's
history (penalties, row constraints, the min_new_tokens mask) are `edit_logits`, per row, and
what follows runs on the batch's parameters as columns (kernels/sampling_columns.py), which the
executor also keeps per row on the device (actors/executor/sampling_slots.py) so that a batch
of plain rows costs no per-row Python.

Row constraints (kernels/constraints.py: logit_bias, and what a request asks of its row's
logits beyond these filters) are the one hook: each edits its own row's logits.

Invariants:
- The caller's logits are never written to.
- Only the edits loop over rows in Python, over the rows that have any.
- A row's draw is one uniform from mix_seed(seed, step) (sampling_columns.row_uniforms), so a
  request draws the same tokens whatever its neighbours and its place in the batch, and
  whichever path (these views or the executor's columns) sampled it. The bits are the same on
  every device; the token may still differ where CPU and CUDA round the softmax differently.
- Temperatures below MIN_TEMPERATURE count as greedy: dividing by them overflows float32.
- top-k keeps every token tied with the k-th (Hugging Face's rule) on both of its code paths,
  so which path a neighbour's parameters select never changes a row's result.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.kernels.constraints import RowConstraint
from shoal.kernels.device_copy import to_device
from shoal.kernels.greedy import greedy_tokens
from shoal.kernels.logprob_gather import logprob_columns
from shoal.kernels.sampling_columns import (
    MIN_TEMPERATURE,
    columns_of,
    sample_columns,
    splitmix64,
    stream_counter,
)
from shoal.params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One request's view for one decode step.

    `step` counts the tokens the request sampled before this one: the index into its seed
    stream and what min_new_tokens compares with. output_ids are those tokens; only penalties
    read them (the executor may still be fetching the last ones of a row without penalties).
    The engine sets seed for every request (a random one when SamplingParams.seed is None).
    constraints: the row's (kernels/constraints.py), built when its row started.
    """

    params: SamplingParams
    seed: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    step: int
    constraints: tuple[RowConstraint, ...] = ()


def mix_seed(seed: int, step: int) -> int:
    """A splitmix64 hash of (seed, step), cut to 63 bits (the reference of
    sampling_columns.row_uniforms, which takes its top 24)."""
    return splitmix64((splitmix64(seed) + step) & _MASK64) >> 1


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int] = ()
) -> torch.Tensor:
    """Pick the next token of each row: int64 [B] on logits' device.

    eos_token_ids (and each row's stop_token_ids) are masked to -inf while a row has produced
    fewer than min_new_tokens tokens; stopping itself is the caller's business.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    if all(_plain_greedy(row, eos_token_ids) for row in rows):
        return greedy_tokens(logits)
    edited = edit_logits(logits, rows, range(len(rows)), eos_token_ids)
    counters = [stream_counter(row.seed, row.step) for row in rows]
    params = [row.params for row in rows]
    return sample_columns(edited, columns_of(params, counters, logits.shape[1], logits.device))


def edit_logits(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    at: Sequence[int],
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The edits that need a row's history: penalties, row constraints and the min_new_tokens
    mask, for rows[i] at row at[i] of logits. Returns logits itself when no row edits, else an
    edited float32 copy (the caller's logits are never written to)."""
    penalized = [i for i, row in enumerate(rows) if has_penalty(row.params)]
    masked = [i for i, row in enumerate(rows) if _masks_stop_tokens(row, eos_token_ids)]
    constrained = [i for i, row in enumerate(rows) if row.constraints]
    if not (penalized or masked or constrained):
        return logits
    logits = logits.to(torch.float32, copy=True)  # ours to edit in place from here
    _apply_penalties_(logits, [rows[i] for i in penalized], [at[i] for i in penalized])
    for i in constrained:
        for constraint in rows[i].constraints:
            constraint.mask_(logits[at[i]])
    _mask_stop_tokens_(logits, [rows[i] for i in masked], [at[i] for i in masked], eos_token_ids)
    return logits


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probabilities (before penalties and temperature) from logits [B, V].

    Returns the log-probability of each token_ids[b] (float32 [B]) and the top_k most likely
    tokens per row, values and ids ([B, top_k], most likely first; [B, 0] when top_k is 0).
    """
    none_listed = torch.zeros(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    chosen, _, values, ids, _ = logprob_columns(logits, token_ids, top_k, none_listed)
    return chosen, values, ids


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def masks_stop_tokens(params: SamplingParams, step: int, eos_token_ids: Sequence[int]) -> bool:
    """Whether a row at `step` still has its eos and stop tokens masked (min_new_tokens)."""
    return step < params.min_new_tokens and bool(eos_token_ids or params.stop_token_ids)


def _masks_stop_tokens(row: SamplingRow, eos_token_ids: Sequence[int]) -> bool:
    return masks_stop_tokens(row.params, row.step, eos_token_ids)


def _plain_greedy(row: SamplingRow, eos_token_ids: Sequence[int]) -> bool:
    return (
        row.params.temperature < MIN_TEMPERATURE
        and not row.constraints
        and not has_penalty(row.params)
        and not _masks_stop_tokens(row, eos_token_ids)
    )


def _apply_penalties_(
    logits: torch.Tensor, rows: Sequence[SamplingRow], row_index: Sequence[int]
) -> None:
    """Repetition (HF, over prompt + output), then frequency and presence (OpenAI, over output).

    Sparse: only the (row, token) pairs a row has seen are read and written, never all of V.
    """
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    # Prompt tokens matter only to repetition_penalty; other rows skip them.
    prompts = [row.prompt_ids if row.params.repetition_penalty != 1.0 else () for row in rows]
    outputs = [row.output_ids for row in rows]
    output_keys = _pair_keys(outputs, vocab_size)
    all_keys = torch.cat([output_keys, _pair_keys(prompts, vocab_size)]).to(device)
    keys, inverse = all_keys.unique(return_inverse=True)
    is_output = (torch.arange(len(all_keys), device=device) < len(output_keys)).float()
    counts = torch.zeros(len(keys), device=device).index_add_(0, inverse, is_output)

    local_row, token = keys // vocab_size, keys % vocab_size
    global_row = to_device(row_index, torch.int64, device)[local_row]

    def per_pair(values: list[float]) -> torch.Tensor:
        return to_device(values, logits.dtype, device)[local_row]

    repetition = per_pair([row.params.repetition_penalty for row in rows])
    frequency = per_pair([row.params.frequency_penalty for row in rows])
    presence = per_pair([row.params.presence_penalty for row in rows])

    values = logits[global_row, token]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * counts - presence * (counts > 0)
    logits[global_row, token] = values


def _pair_keys(id_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """row * V + token (int64, on CPU) for every id of every row's list."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    token = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    return row * vocab_size + token


def _mask_stop_tokens_(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    row_index: Sequence[int],
    eos_token_ids: Sequence[int],
) -> None:
    """-inf on eos and stop_token_ids (rows are those still short of min_new_tokens)."""
    mask_row: list[int] = []
    mask_token: list[int] = []
    for i, row in zip(row_index, rows, strict=True):
        token_ids = (*eos_token_ids, *row.params.stop_token_ids)
        mask_row.extend([i] * len(token_ids))
        mask_token.extend(token_ids)
    if mask_row:
        device = logits.device
        index = (
            to_device(mask_row, torch.int64, device),
            to_device(mask_token, torch.int64, device),
        )
        logits[index] = float("-inf")
