"""A launch's speculating decodes (SeqChunk.num_drafts, issue 35), from the launch thread to
the host: which logits verify which drafts, the verification, and its tokens back.

    drafts = draft_asks(launch, device)        # None: no sequence drafts (every plain step)
    both = model.head(h, cat(drafts.places, sample_index))     # one head: drafts', then S
    next_tokens = slots.sample(both[D:], ...)                  # as every step
    emitted = drafts.verify_slots(both, next_tokens, slots)
    ... emitted goes to the host with the step's tokens ...
    drafts.unpack(emitted on the host)         # StepResult.drafted

A speculating decode is a chunk of its row's last token and k drafts at positions start ..
start + k, sampling at its last: the logits at its first k positions give the target at each
draft, the sampling place's the one after the last draft. A greedy row keeps the drafts that
equal the argmax before them (kernels/speculative.py's `verify_targets`: exactly the tokens
one at a time gives); a sampled row runs rejection sampling (`verify_sampled`) on the
distributions its sampling draws from (`target_probs`), its uniforms the next 1 + k of its
seed's stream (the draw at its counter, the acceptances after), so its counter moves on by
1 + k (`SamplingSlots.advance`, by the launch once nothing can fail). Its next_tokens entry
becomes its last emitted token (the row's next input); the kept drafts before it come back as
`StepResult.drafted`.

A row drafts only when nothing in its sampling reads its earlier tokens or is reported per
token (actors/scheduler/speculation.py's `drafts_allowed`): without pipeline stages it is never
a tracked row; over stages the last stage verifies from the rows' views
(`DeviceState._finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.actors.executor.sampling_slots import SamplingSlots
from shoal.actors.executor_messages import Launch
from shoal.kernels.device_copy import to_device
from shoal.kernels.greedy import greedy_tokens
from shoal.kernels.sampling import SamplingRow
from shoal.kernels.sampling_columns import (
    MIN_TEMPERATURE,
    SamplingColumns,
    row_uniforms,
    stream_counter,
    target_probs,
)
from shoal.kernels.sampling_columns import columns_of as sampling_columns
from shoal.kernels.speculative import verify_sampled, verify_targets


@dataclass(frozen=True)
class DraftAsks:
    places: torch.Tensor  # int64 [D]: flat-batch places whose logits verify a draft
    index: torch.Tensor  # int64 [R, K + 1]: each row's places in `both` (below)
    drafts: torch.Tensor  # int64 [R, K]: each row's drafts, -1 past its length
    lengths: torch.Tensor  # int64 [R]
    lengths_host: tuple[int, ...]
    sample_at: torch.Tensor  # int64 [R]: each row's place among the step's sampling rows
    sample_at_host: tuple[int, ...]
    rows: torch.Tensor  # int64 [R]: each row's request-slot row
    rows_host: np.ndarray

    def verify(
        self,
        both: torch.Tensor,
        next_tokens: torch.Tensor,
        greedy: np.ndarray,
        columns_of: Callable[[np.ndarray], SamplingColumns],
    ) -> torch.Tensor:
        """Each row's emitted tokens [R, K + 1] (its kept drafts, then one more, then -1);
        writes its last into `next_tokens`. `both`: [D + S, V], the drafts' places' logits
        (`places`), then the step's S sampling places' (the head makes them in that order,
        so that no copy joins them). `greedy`: bool [R], the rows sampling greedily;
        `columns_of(at)`: the sampling columns of the rows at `at` (all sampled), with the
        seed counters of this step's draw. The caller then moves each row's seed counter on
        by its k draws past the one every sampling row makes (`lengths`)."""
        emitted = torch.empty_like(self.index)
        device = self.index.device
        if greedy.any():
            at = torch.from_numpy(np.flatnonzero(greedy)).to(device)
            targets = greedy_tokens(both)[self.index[at]]
            emitted[at] = verify_targets(targets, self.drafts[at], self.lengths[at])[1]
        if not greedy.all():
            at_host = np.flatnonzero(~greedy)
            at = torch.from_numpy(at_host).to(device)
            emitted[at] = self._sampled(both, at, columns_of(at_host))
        accepted = (emitted >= 0).sum(dim=1) - 1
        last = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        next_tokens.index_copy_(0, self.sample_at, last)
        return emitted

    def verify_slots(
        self, both: torch.Tensor, next_tokens: torch.Tensor, slots: SamplingSlots
    ) -> torch.Tensor:
        """`verify` for rows whose parameters live in `slots` (one executor stage)."""
        rows_host, device = self.rows_host, self.rows.device

        def columns_of(at: np.ndarray) -> SamplingColumns:
            return slots.columns(torch.from_numpy(rows_host[at]).to(device), rows_host[at])

        greedy = slots.greedy(rows_host)
        return self.verify(both, next_tokens, greedy, columns_of)

    def verify_views(
        self, both: torch.Tensor, next_tokens: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """`verify` for rows sampled from their views (pipeline stages' last stage): `rows`
        are the step's sampling rows, in order."""
        views = [rows[place] for place in self.sample_at_host]

        def columns_of(at: np.ndarray) -> SamplingColumns:
            chosen = [views[i] for i in at.tolist()]
            counters = [stream_counter(view.seed, view.step) for view in chosen]
            params = [view.params for view in chosen]
            return sampling_columns(params, counters, both.shape[1], both.device)

        greedy = np.array([view.params.temperature < MIN_TEMPERATURE for view in views])
        return self.verify(both, next_tokens, greedy, columns_of)

    def _sampled(self, both: torch.Tensor, at: torch.Tensor, base: SamplingColumns) -> torch.Tensor:
        """Rejection sampling for the sampled rows `at`, whose columns are `base`:
        [len(at), K + 1] emitted."""
        index = self.index[at]
        rows, width = index.shape
        repeat = torch.arange(rows, device=index.device).repeat_interleave(width)
        columns = SamplingColumns(
            base.temperature[repeat],
            base.top_p[repeat],
            base.min_p[repeat],
            base.top_k[repeat],
            base.counter[repeat],
            base.host,
        )
        probs = target_probs(both[index.view(-1)], columns).view(rows, width, -1)
        steps = torch.arange(1, width, device=index.device)
        accept_u = row_uniforms(base.counter.unsqueeze(1) + steps).view(rows, width - 1)
        draw_u = row_uniforms(base.counter)
        return verify_sampled(probs, self.drafts[at], self.lengths[at], accept_u, draw_u)[1]

    def unpack(self, emitted: torch.Tensor) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(place among the sampling rows, kept drafts) per row that kept any."""
        out = []
        for place, tokens in zip(self.sample_at_host, emitted.tolist(), strict=True):
            kept = tuple(t for t in tokens if t >= 0)[:-1]
            if kept:
                out.append((place, kept))
        return tuple(out)


def draft_asks(launch: Launch, device: torch.device) -> DraftAsks | None:
    """The launch's speculating decodes (None if none drafts)."""
    if not any(seq.num_drafts for seq in launch.seqs):
        return None
    num_decodes = len(launch.decode_rows)
    places: list[int] = []
    sample_at: list[int] = []
    rows: list[int] = []
    drafts: list[tuple[int, ...]] = []
    offset = num_decodes  # the flat batch: decodes first, then the chunks in order
    sampling = num_decodes  # the sampling rows: likewise
    for seq in launch.seqs:
        k = seq.num_drafts
        if k:
            assert seq.sample and seq.input_ids is not None and len(seq.input_ids) == k + 1
            places.extend(range(offset, offset + k))
            sample_at.append(sampling)
            rows.append(seq.row)
            drafts.append(seq.input_ids[1:])
        offset += seq.num_tokens
        sampling += seq.sample
    width = max(len(d) for d in drafts)
    index: list[int] = []
    first = 0  # a row's first draft place among `places`
    for at, row_drafts in zip(sample_at, drafts, strict=True):
        k = len(row_drafts)
        index += [first + j for j in range(k)] + [len(places) + at] * (width + 1 - k)
        first += k
    padded = [d + (-1,) * (width - len(d)) for d in drafts]
    r = len(rows)
    return DraftAsks(
        to_device(places, torch.int64, device),
        to_device(index, torch.int64, device).view(r, width + 1),
        to_device([t for d in padded for t in d], torch.int64, device).view(r, width),
        to_device([len(d) for d in drafts], torch.int64, device),
        tuple(len(d) for d in drafts),
        to_device(sample_at, torch.int64, device),
        tuple(sample_at),
        to_device(rows, torch.int64, device),
        np.array(rows, dtype=np.int64),
    )
