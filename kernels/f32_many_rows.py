"""Whether a float32 model's steps of many rows multiply through oneDNN instead of shoal's panels
(kernels/linear.py: PackedLinear, GatedPanels) on the CPU at hand: measured once, when a model
is first built (models/weights.py), and kept for its weight updates.

CPUs of the same instruction set differ here, so no feature flag can say it. On the first
2-core AVX2 EPYC measured the panels beat oneDNN's float32 matmul at every row count (512 rows
848 ms against 961 over SmolLM2's linears); on a Zen 5 EPYC (AVX-512) they are level with it at
256 rows (SmolLM2's layers 107.7 ms against 109.6); on a Zen 3 EPYC (AVX2 alone) oneDNN took
one layer's four linears at 256 rows in 14.9-15.5 ms against the panels' 18.6-19.4, and with
it from 128 rows on the offline benchmark in float32 went from 118-126 output tok/s to 129-140
(three interleaved pairs, 2026-11-29; from 48 rows on 138-141, no better). Below that the panels
stay: a layer's four linears and the lm_head took 12.6-14.2 ms at 16 rows against oneDNN's
16.9-20.1, 7.2-7.5 at one row against 10.3-10.5 (bench/README.md, "Zen 3 EPYC").

A start times one layer's float32 linears at MEASURE_ROWS random rows both ways, interleaved,
the best of RUNS each (a shared machine's noise only ever adds); oneDNN takes the steps of
MANY_ROWS rows or more only where it needed at most MARGIN of the panels' time. Then each of the
model's layer linears holds its weight in oneDNN's layout too (the lm_head, whose steps are a
batch's decodes, keeps its panels alone):

    from_rows = onednn_from(model_linears)   # MANY_ROWS on a Zen 3 EPYC, else NEVER
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from shoal.kernels.linear import NEVER, GatedPanels, PackedLinear, onednn_pack, onednn_product

MANY_ROWS = 128  # from this many rows a step's float32 linears take oneDNN, where it wins
MEASURE_ROWS = 256
MARGIN = 0.9  # oneDNN's time at most this share of the panels'
RUNS = 7
# A layer of fewer weights is not measured (NEVER): its steps are cheap whatever the kernel,
# and a small model's bits (the tests' tiny ones) never hang on a start's timing.
MIN_LAYER_WEIGHTS = 1 << 20  # SmolLM2-135M's layer: 3.5M

log = logging.getLogger(__name__)


def choose(panels_s: float, onednn_s: float) -> int:
    """MANY_ROWS where oneDNN's best time is within MARGIN of the panels', else NEVER."""
    return MANY_ROWS if onednn_s <= MARGIN * panels_s else NEVER


def onednn_from(linears: Sequence[object], runs: int = RUNS) -> int:
    """From how many rows a model's float32 layer linears take oneDNN (NEVER: never), timed on
    the first of them that are float32 panels: one layer's, `linears` in the order of
    ModelWeights.linears less the lm_head. NEVER where they are not panels, or too small."""
    layer = _panel_linears(linears[:4])
    if sum(linear.in_features * linear.out_features for linear in layer) < MIN_LAYER_WEIGHTS:
        return NEVER
    generator = torch.Generator().manual_seed(0)
    calls_panels: list[Callable[[], torch.Tensor]] = []
    calls_onednn: list[Callable[[], torch.Tensor]] = []
    for linear in layer:
        x = torch.randn(MEASURE_ROWS, linear.in_features, generator=generator)
        calls_panels.append(partial(linear.panels_product, x))
        packed = onednn_pack(linear.plain_weight(), MANY_ROWS)
        calls_onednn.append(partial(onednn_product, x, packed, None))
    panels_s, onednn_s = float("inf"), float("inf")
    for run in range(runs + 1):
        took_panels, took_onednn = _seconds(calls_panels), _seconds(calls_onednn)
        if run > 0:  # the first pass of each warms up
            panels_s, onednn_s = min(panels_s, took_panels), min(onednn_s, took_onednn)
    chosen = choose(panels_s, onednn_s)
    log.info(
        "float32 linears at %d rows: panels %.2f ms, oneDNN %.2f ms a layer: %s",
        MEASURE_ROWS, panels_s * 1e3, onednn_s * 1e3,
        f"oneDNN from {chosen} rows" if chosen < NEVER else "the panels at every size",
    )  # fmt: skip
    return chosen


def take_many_rows(linears: Sequence[object], from_rows: int) -> None:
    """Each float32 panel linear of `linears` takes its steps of `from_rows` rows or more
    through oneDNN (nothing for NEVER)."""
    if from_rows >= NEVER:
        return
    for linear in _panel_linears(linears):
        linear.take_many_rows(from_rows)


def _panel_linears(linears: Sequence[object]) -> list[PackedLinear | GatedPanels]:
    """Those of `linears` that multiply on float32 panels."""
    return [
        linear
        for linear in linears
        if isinstance(linear, GatedPanels)
        or (isinstance(linear, PackedLinear) and linear.panels is not None)
    ]


def _seconds(calls: list[Callable[[], torch.Tensor]]) -> float:
    began = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - began
