"""A launch's prompt positions whose logprobs are asked (SeqChunk.logprob_targets), from the
launch thread to the host and back into each chunk's TokenLogprobs.

    asks = prompt_asks(launch, rows, device)        # None: no chunk asks (every steady step)
    columns = sliced_logprobs(head, asks.index, asks.targets, asks.top_k, asks.listed, V)
    ... the columns go to the host with the step's tokens ...
    per_chunk = asks.unpack(columns on the host)    # StepDone.prompt_logprobs

The places are the chunks' positions in the launch's flat batch (its decodes first, then its
chunks in order: step_inputs.py), so the hidden states the forward computed give their logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shoal.actors.executor_messages import Launch
from shoal.kernels.device_copy import to_device
from shoal.kernels.logprob_gather import listed_ids
from shoal.results import TokenLogprob

if TYPE_CHECKING:
    from shoal.actors.executor.pending_step import RowState  # which imports this file


@dataclass(frozen=True)
class Span:
    """One asking chunk's share of the columns: how many positions, its top k, its ids."""

    count: int
    top_k: int
    num_listed: int


@dataclass(frozen=True)
class PromptAsks:
    index: torch.Tensor  # int64 [M]: places in the flat batch
    targets: torch.Tensor  # int64 [M]: the next prompt token of each
    target_ids: tuple[int, ...]  # the same on the host
    listed: torch.Tensor  # int64 [M, L]: each position's request's token_ids_logprob, padded
    top_k: int  # the most any asking chunk wants
    spans: tuple[Span, ...]  # per asking chunk, in batch order

    def unpack(self, columns: Sequence[torch.Tensor]) -> tuple[tuple[TokenLogprob, ...], ...]:
        """The host columns (logprob_gather.LogprobColumns) as each chunk's TokenLogprobs."""
        chosen, rank, values, ids, listed = (c.tolist() for c in columns)
        targets = self.target_ids
        out = []
        at = 0
        for span in self.spans:
            k, n = span.top_k, span.num_listed
            items = [
                TokenLogprob(
                    targets[j],
                    float(chosen[j]),
                    tuple(zip(ids[j][:k], values[j][:k], strict=True)),
                    tuple(listed[j][:n]),
                    int(rank[j]),
                )
                for j in range(at, at + span.count)
            ]
            out.append(tuple(items))
            at += span.count
        return tuple(out)


def prompt_asks(
    launch: Launch, rows: Mapping[int, RowState], device: torch.device
) -> PromptAsks | None:
    """The launch's asked prompt positions (None if no chunk asks). `rows`: the executor's
    row states, started for this launch (a chunk's row knows its top k and listed ids)."""
    if not any(seq.logprob_targets for seq in launch.seqs):
        return None
    places: list[int] = []
    targets: list[int] = []
    lists: list[tuple[int, ...]] = []
    spans: list[Span] = []
    offset = len(launch.decode_rows)
    for seq in launch.seqs:
        count = len(seq.logprob_targets)
        if count:
            first = offset + seq.logprobs_from - seq.start
            assert seq.start <= seq.logprobs_from and first + count <= offset + seq.num_tokens
            sampling = rows[seq.row].sampling
            places.extend(range(first, first + count))
            targets.extend(seq.logprob_targets)
            lists.extend([sampling.token_ids_logprob] * count)
            spans.append(Span(count, sampling.top_logprobs, len(sampling.token_ids_logprob)))
        offset += seq.num_tokens
    return PromptAsks(
        to_device(places, torch.int64, device),
        to_device(targets, torch.int64, device),
        tuple(targets),
        listed_ids(lists, device),
        max(span.top_k for span in spans),
        tuple(spans),
    )
