"""Batched per-request sampling: one next token per row of a [B, V] logits tensor.

Pipeline (a row pays only for the stages its SamplingParams turn on):

    logits ─ penalties ─ row constraints ─ min_new_tokens mask ─┬─ greedy rows:  argmax
                                                                └─ sampled rows: / T ─ softmax
                                           ─ top-k ─ top-p ─ min-p ─ exponential race

Row constraints (kernels/constraints.py: logit_bias, and what a request asks of its row's
logits beyond these filters) are the one hook: each edits its own row's logits.

Invariants:
- The caller's logits are never written to.
- Only the per-row noise loops over rows in Python; the filters run on the whole sub-batch.
- A row's noise comes from its own generator seeded with mix_seed(seed, step), so a
  request draws the same tokens whatever its neighbours and its place in the batch (on a given
  device kind: CPU and CUDA generators give different streams).
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
from shoal.params import SamplingParams

MIN_TEMPERATURE = 1e-5

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
    """A splitmix64 hash of (seed, step), cut to 63 bits so torch's manual_seed accepts it."""
    return _splitmix64((_splitmix64(seed) + step) & _MASK64) >> 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int] = ()
) -> torch.Tensor:
    """Pick the next token of each row: int64 [B] on logits' device.

    eos_token_ids (and each row's stop_token_ids) are masked to -inf while a row has produced
    fewer than min_new_tokens tokens; stopping itself is the caller's business.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    if all(_plain_greedy(row, eos_token_ids) for row in rows):
        return logits.argmax(dim=-1)

    penalized = [i for i, row in enumerate(rows) if has_penalty(row.params)]
    masked = [i for i, row in enumerate(rows) if _masks_stop_tokens(row, eos_token_ids)]
    constrained = [i for i, row in enumerate(rows) if row.constraints]
    if penalized or masked or constrained:
        logits = logits.to(torch.float32, copy=True)  # ours to edit in place from here
        _apply_penalties_(logits, [rows[i] for i in penalized], penalized)
        for i in constrained:
            for constraint in rows[i].constraints:
                constraint.mask_(logits[i])
        _mask_stop_tokens_(logits, [rows[i] for i in masked], masked, eos_token_ids)
    else:
        logits = logits.float()

    sampled = [i for i, row in enumerate(rows) if row.params.temperature >= MIN_TEMPERATURE]
    if len(sampled) < len(rows):
        next_tokens = logits.argmax(dim=-1)
        if not sampled:
            return next_tokens
        sampled_index = to_device(sampled, torch.int64, logits.device)
        logits = logits.index_select(0, sampled_index)
    sampled_rows = [rows[i] for i in sampled]
    probs = _filtered_probs(logits, sampled_rows)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p / sum(p), so the
    # filtered probabilities need no renormalizing.
    race = probs / _exponential_noise(sampled_rows, logits.shape[1], logits.device)
    if len(sampled) == len(rows):
        return race.argmax(dim=-1)
    return next_tokens.index_put((sampled_index,), race.argmax(dim=-1))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-probabilities (before penalties and temperature) from logits [B, V].

    Returns the log-probability of each token_ids[b] (float32 [B]) and the top_k most likely
    tokens per row, values and ids ([B, top_k], most likely first; [B, 0] when top_k is 0).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    values, ids = logprobs.topk(top_k, dim=-1) if top_k > 0 else (logprobs[:, :0],) * 2
    return chosen, values, ids.long()


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _masks_stop_tokens(row: SamplingRow, eos_token_ids: Sequence[int]) -> bool:
    return row.step < row.params.min_new_tokens and bool(eos_token_ids or row.params.stop_token_ids)


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


def _filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, softmax, then top-k, top-p and min-p as zeros; not renormalized."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = to_device([row.params.temperature for row in rows], torch.float32, device)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)

    top_k = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    if any(p < 1.0 for p in top_p):
        probs = _top_k_top_p(probs, top_k, top_p)
    elif any(k < vocab_size for k in top_k):
        probs = _top_k(probs, top_k)

    min_p = [row.params.min_p for row in rows]
    if any(p > 0.0 for p in min_p):
        threshold = (
            probs.amax(dim=-1, keepdim=True) * to_device(min_p, torch.float32, device)[:, None]
        )
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Zero all but each row's k most likely tokens (ties with the k-th all stay, as in HF).

    torch.topk up to the largest k used instead of a full sort of V.
    """
    device, vocab_size = probs.device, probs.shape[1]
    largest = probs.topk(max(k for k in top_k if k < vocab_size), dim=-1).values
    k = to_device(top_k, torch.int64, device).unsqueeze(1)
    kth = largest.gather(1, (k.clamp(max=largest.shape[1]) - 1))
    threshold = torch.where(k < vocab_size, kth, torch.zeros_like(kth))
    return probs.masked_fill(probs < threshold, 0.0)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero all but each row's k most likely tokens, then all but its nucleus among those.

    top-p is measured on the top-k survivors renormalized (as Hugging Face and vLLM do): a token
    stays while the mass ranked above it is below top_p of the surviving mass, so the most likely
    token always stays.
    """
    device = probs.device
    sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)
    k = to_device(top_k, torch.int64, device).unsqueeze(1)
    keep = sorted_probs >= sorted_probs.gather(1, k - 1)  # ties with the k-th stay, as in _top_k
    sorted_probs = sorted_probs.masked_fill(~keep, 0.0)

    p = to_device(top_p, probs.dtype, device).unsqueeze(1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept_mass = sorted_probs.sum(dim=-1, keepdim=True)
    keep &= (mass_above < p * kept_mass) | (p >= 1.0)

    keep_by_token = torch.zeros_like(keep).scatter(1, sorted_index, keep)
    return probs.masked_fill(~keep_by_token, 0.0)


def _exponential_noise(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [len(rows), V]; row i depends only on rows[i]'s seed and step."""
    noise = torch.empty((len(rows), vocab_size), device=device)
    generator = torch.Generator(device=device)
    for i, row in enumerate(rows):
        generator.manual_seed(mix_seed(row.seed, row.step))
        noise[i].exponential_(generator=generator)
    # A zero draw would turn p = 0 into nan (0 / 0), which argmax prefers.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
