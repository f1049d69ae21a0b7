"""A launch's positions whose routed experts are asked (SamplingParams.return_routed_experts),
from the launch thread's forward to the host and back as each sequence's ExpertRows.

    routed = routed_asks(launch, rows, asking, device)   # None: no row of the launch asks
    recorder = routed.recorder(num_layers, top_k)         # the forward records at its places
    ... recorder.ids() go to the host with the step's tokens ...
    pieces = routed.unpack(ids on the host)               # StepDone.routed_experts

`asking` is the executor's set of rows whose request asks (kept as their RowInit arrive): while
it is empty, or holds none of the launch's rows, a launch costs one set test. A decode records
its one position; a chunk its positions from the request's routed_experts_start_len on. The
places are positions in the launch's flat batch (its decodes first, then its chunks in order:
step_inputs.py), the sequences named by their place in that order (the scheduler's members).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shoal.actors.executor_messages import Launch
from shoal.actors.messages import ExpertRows
from shoal.kernels.device_copy import to_device
from shoal.kernels.routed_experts import ExpertRecorder

if TYPE_CHECKING:
    from shoal.actors.executor.pending_step import RowState  # which imports this file


@dataclass(frozen=True)
class Span:
    """One asking sequence's share of the recorded rows."""

    place: int  # the sequence's place in batch order
    first: int  # its first recorded position
    count: int


@dataclass(frozen=True)
class RoutedAsks:
    places: torch.Tensor  # int64 [M]: places in the flat batch
    spans: tuple[Span, ...]  # per asking sequence, in batch order

    def recorder(self, num_layers: int, top_k: int) -> ExpertRecorder:
        return ExpertRecorder(self.places, num_layers, top_k)

    def unpack(self, ids: torch.Tensor) -> tuple[tuple[int, ExpertRows], ...]:
        """The host's int32 [M, num_layers, top_k] as each sequence's rows."""
        assert ids.dtype == torch.int32 and ids.shape[0] == sum(s.count for s in self.spans)
        data = ids.numpy().astype("<i4", copy=False)
        out = []
        at = 0
        for span in self.spans:
            rows = data[at : at + span.count].tobytes()
            out.append((span.place, ExpertRows(span.first, span.count, rows)))
            at += span.count
        return tuple(out)


def routed_asks(
    launch: Launch, rows: Mapping[int, RowState], asking: set[int], device: torch.device
) -> RoutedAsks | None:
    """The launch's positions to record (None if none). `rows`: the executor's row states,
    started for this launch; `asking`: the rows whose request asks (a superset of the live
    ones: a row stays until another request's RowInit takes it)."""
    if not asking:
        return None
    chunk_rows = [seq.row for seq in launch.seqs]
    if asking.isdisjoint(launch.decode_rows) and asking.isdisjoint(chunk_rows):
        return None
    places: list[int] = []
    spans: list[Span] = []
    decodes = zip(launch.decode_rows, launch.decode_starts, strict=True)
    for place, (row, start) in enumerate(decodes):
        if row in asking:
            places.append(place)
            spans.append(Span(place, start, 1))
    offset = len(launch.decode_rows)
    for index, seq in enumerate(launch.seqs):
        if seq.row in asking:
            from_position = rows[seq.row].sampling.routed_experts_start_len
            first, end = max(seq.start, from_position), seq.start + seq.num_tokens
            if first < end:
                at = offset + first - seq.start
                places.extend(range(at, at + end - first))
                spans.append(Span(len(launch.decode_rows) + index, first, end - first))
        offset += seq.num_tokens
    if not spans:
        return None
    return RoutedAsks(to_device(places, torch.int64, device), tuple(spans))
