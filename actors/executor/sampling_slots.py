"""Each row's sampling parameters, kept where a launch needs them: on the sampling device as
columns (kernels/sampling_columns.py) and on the host as arrays, written when a row starts
(`RowInit`, again after a retraction) and only then, so that a launch gathers them with its
rows' index and nothing else.

    slots.start(starts)                       # a launch's RowInits, one write per table
    next_tokens = slots.sample(logits, rows, rows_host)   # the batch's columns, gathered
    slots.advance(rows)                        # each row sampled one more token (the seed's step)

Per row on the device: temperature (0 for a greedy row), top_p, min_p, top_k (V when off) and
the counter of its seed's stream, splitmix64(seed) + step, where step counts the tokens the row
has launched for sampling since its request began (a retracted row's restarts at its replayed
outputs). The counter moves on the device only, in launch order, so a decode needs no host
count.

On the host, per row: its code (kernels/sampling_columns.py's row_columns: which stages it
turns on; which a batch runs is the host's choice, so it never reads the device),
`top_logprobs` (-1: none asked) and `tracked`: the row needs per-row Python at each launch
(penalties, row constraints, a min_new_tokens mask still pending; with pipeline stages, every
row). A launch whose rows are neither tracked nor want logprobs runs no per-row Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from shoal.kernels.device_copy import to_device
from shoal.kernels.greedy import greedy_tokens
from shoal.kernels.sampling_columns import (
    GREEDY,
    ColumnsHost,
    SamplingColumns,
    columns_host,
    row_columns,
    sample_columns,
    stream_counter,
)
from shoal.params import SamplingParams


class RowStart(NamedTuple):
    """A row (re)started: its request's parameters, seed, tokens sampled so far, and whether
    the host tracks it (SamplingSlots' doc)."""

    row: int
    params: SamplingParams
    seed: int
    num_sampled: int
    tracked: bool


class SamplingSlots:
    """Per-row sampling parameters on `device` and on the host (module doc). Touched by the
    executor's launch thread only."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        # temperature, top_p, min_p | top_k, the seed stream's counter (seed hash + step)
        self.floats = torch.zeros(num_rows, 3, dtype=torch.float32, device=device)
        self.ints = torch.zeros(num_rows, 2, dtype=torch.int64, device=device)
        self.ones = torch.ones(num_rows, dtype=torch.int64, device=device)
        self.codes = np.zeros(num_rows, dtype=np.int64)  # sampling_columns.row_columns' code
        self.top_logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.tracked = np.zeros(num_rows, dtype=np.bool_)

    def start(self, starts: Sequence[RowStart]) -> None:
        """Write the started rows' parameters (a row started twice: the last start)."""
        if not starts:
            return
        rows: list[int] = []
        floats: list[float] = []
        ints: list[int] = []
        last = {start.row: start for start in starts}  # distinct rows: index_put_ is unordered
        for row, params, seed, num_sampled, tracked in last.values():
            entries = row_columns(params, self.vocab_size)
            self.codes[row] = entries.code
            self.top_logprobs[row] = params.top_logprobs if params.wants_logprobs else -1
            self.tracked[row] = tracked
            rows.append(row)
            floats += entries.floats
            ints += (entries.top_k, stream_counter(seed, num_sampled))
        n = len(rows)
        index = to_device(rows, torch.int64, self.device)
        self.floats.index_put_((index,), to_device(floats, torch.float32, self.device).view(n, 3))
        self.ints.index_put_((index,), to_device(ints, torch.int64, self.device).view(n, 2))

    def untrack(self, row: int) -> None:
        self.tracked[row] = False

    def sample(
        self, logits: torch.Tensor, rows: torch.Tensor, rows_host: np.ndarray
    ) -> torch.Tensor:
        """The next token of each row of logits [S, V], whose rows are `rows` (on the device)
        and `rows_host` (the same on the host); a batch of greedy rows is one argmax."""
        assert logits.shape[1] == self.vocab_size, (tuple(logits.shape), self.vocab_size)
        host = columns_host(self.codes[rows_host])
        if host is GREEDY:
            return greedy_tokens(logits)
        return sample_columns(logits, self._columns(rows, host))

    def columns(self, rows: torch.Tensor, rows_host: np.ndarray) -> SamplingColumns:
        """The rows' parameters and seed-stream counters as a batch's columns."""
        return self._columns(rows, columns_host(self.codes[rows_host]))

    def _columns(self, rows: torch.Tensor, host: ColumnsHost) -> SamplingColumns:
        floats = self.floats.index_select(0, rows).unbind(1)
        ints = self.ints.index_select(0, rows).unbind(1)
        return SamplingColumns(floats[0], floats[1], floats[2], ints[0], ints[1], host)

    def greedy(self, rows_host: np.ndarray) -> np.ndarray:
        """bool per row: it samples greedily (temperature 0)."""
        return self.codes[rows_host] == 0

    def tracked_at(self, rows_host: np.ndarray) -> list[int]:
        """The places in the batch of its tracked rows."""
        return np.flatnonzero(self.tracked[rows_host]).tolist()

    def logprobs_at(self, rows_host: np.ndarray) -> list[tuple[int, int]]:
        """(place in the batch, top_logprobs) of each row that asked for logprobs."""
        wanted = self.top_logprobs[rows_host]
        places = np.flatnonzero(wanted >= 0)
        return list(zip(places.tolist(), wanted[places].tolist(), strict=True))

    def advance(self, rows: torch.Tensor, steps: torch.Tensor | None = None) -> None:
        """Each of `rows` (distinct) launched one more token for sampling, or `steps` [R]
        more (a speculating decode's draws): its counter moves on as many."""
        counters = self.ints[:, 1]
        counters.index_add_(0, rows, self.ones[: rows.shape[0]] if steps is None else steps)
