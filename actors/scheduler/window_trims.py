"""Sliding window (docs/architecture.md, law 4): which of a running request's own pages no
launched or future chunk reads any more, so the cache manager may free them.

A chunk whose first query is at position s reads keys from s - W + 1 on, and every later chunk
starts higher, so the bound is min(s) - W + 1 over the request's unprocessed batches (up to
max_inflight of them) and `num_launched` (where the chunk this plan launches starts). A batch
leaves the planner's `batches` only once its result came back, so the device has finished
reading; the freed pages may then serve this plan's extensions and admissions, whose writes run
after every earlier launch (one launch order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from shoal.actors.messages import TrimReq
from shoal.actors.scheduler.request import Phase, Req


class Launched(Protocol):
    """A member of a launched batch: which request, and its first query's position."""

    @property
    def rid(self) -> str: ...

    @property
    def start(self) -> int: ...


def window_trims(
    holding: Iterable[Req],
    batches: Iterable[Sequence[Launched]],
    window: int,
    page_size: int,
    trimmed_to: Mapping[str, int],
) -> tuple[TrimReq, ...]:
    """The page-aligned position below which each prefilling or running request's keys are
    read by none of its launched batches nor any later chunk; only where that moved past
    `trimmed_to` (the trims already asked for)."""
    first = {r.rid: r.num_launched for r in holding if r.phase in (Phase.PREFILL, Phase.RUNNING)}
    for members in batches:
        for m in members:
            if m.rid in first:
                first[m.rid] = min(first[m.rid], m.start)
    trims = []
    for rid, start in first.items():
        keep_from = max(start - window + 1, 0) // page_size * page_size
        if keep_from > trimmed_to.get(rid, 0):
            trims.append(TrimReq(rid, keep_from))
    return tuple(trims)
