"""When the planner plans with a decode set (decode_set.py), and its steady `propose`: plain
Python and numpy, no asyncio, no torch.

    steps.current(quiet, table, batches)  the alive set if nothing but decoding went on
                                          since, else a new one if every live request
                                          decodes and every launched batch is decodes only,
                                          else None: the per-request code plans
    steps.ask(step, prefix_cache)         releases of finished members, extensions at page
                                          boundaries, the decodes as slots
    steps.extended(rids, reqs, page_size) the plan's extensions, into the set or the Reqs
    steps.dissolve(batches)               every counter and token back to its Req; the
                                          outstanding plan's decodes as requests

The planner calls `dissolve` before anything but a steady step reads or moves a request
(docs/architecture.md, "A steady step").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from shoal.actors.messages import ExtendReq, PlanRequest, ReleaseReq
from shoal.actors.scheduler.decode_set import DecodeSet, Ints
from shoal.actors.scheduler.launched_batches import LaunchedBatch
from shoal.actors.scheduler.request import Req, pages_for, released_now
from shoal.actors.scheduler.request_table import RequestTable


class SteadySteps:
    def __init__(self) -> None:
        self.decode_set: DecodeSet | None = None
        self.proposed: Ints | None = None  # the outstanding plan's decodes, as slots

    def current(
        self, quiet: bool, table: RequestTable, batches: Mapping[int, LaunchedBatch]
    ) -> DecodeSet | None:
        """The set to plan this step with; `quiet`: nothing rules one out (no pause, no
        pipeline stages, no sliding window, no publish due)."""
        decode_set = self.decode_set
        if decode_set is not None:
            members = decode_set.num_alive + len(decode_set.dying)
            if quiet and not decode_set.worn and members == len(table.reqs):
                return decode_set
            self.dissolve(batches)
        if not quiet or table.waiting or any(b.chunks for b in batches.values()):
            return None
        decode_set = DecodeSet.of(table.reqs.values())
        if decode_set is None:
            return None
        slot_of = decode_set.slot_of
        for batch in batches.values():  # only running requests' decodes: all members
            batch.slots = np.array([slot_of[r.rid] for r in batch.decodes], dtype=np.int64)
            batch.starts = np.array(batch.decode_starts, dtype=np.int64)
        self.decode_set = decode_set
        return decode_set

    def ask(self, step: int, prefix_cache: bool, stalled: bool) -> PlanRequest | None:
        """The plan request of a steady step (None: nothing to ask; a stall waits for a
        result or a request unless a release is due)."""
        decode_set = self.decode_set
        assert decode_set is not None
        releases = [
            ReleaseReq(r.rid, *r.kept_tokens(prefix_cache))
            for r in decode_set.dying
            if released_now(r)
        ]
        if stalled and not releases:
            return None
        slots = decode_set.want()
        if not (slots.size or releases):
            return None
        members, launched = decode_set.members, decode_set.num_launched
        extends = tuple(
            ExtendReq(members[i].rid, int(launched[i]) + 1)
            for i in decode_set.needs_page(slots).tolist()
        )
        self.proposed = slots
        return PlanRequest(step, tuple(releases), extends, ())

    def extended(self, rids: Sequence[str], reqs: Mapping[str, Req], page_size: int) -> None:
        """The plan extended these requests to cover their next position (and their drafts'),
        on whole pages."""
        for rid in rids:
            if self.decode_set is not None:
                self.decode_set.extended(rid, page_size)
                continue
            req = reqs[rid]
            covers = pages_for(req.num_launched + 1 + len(req.draft), page_size) * page_size
            req.capacity = max(req.capacity, covers)

    def dissolve(self, batches: Mapping[int, LaunchedBatch]) -> list[Req] | None:
        """Give the set's counters and tokens back to the requests; the outstanding plan's
        decodes, if it was a steady one's (None otherwise)."""
        decode_set = self.decode_set
        if decode_set is None:
            return None
        decode_set.dissolve()
        self.decode_set = None
        for batch in batches.values():
            batch.slots = batch.starts = None
        proposed, self.proposed = self.proposed, None
        if proposed is None:
            return None
        return [decode_set.members[i] for i in proposed.tolist()]
