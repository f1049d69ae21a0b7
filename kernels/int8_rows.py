"""How int8's linears take steps of many rows on the CPU at hand (kernels/quant.py): from how
many rows on they multiply their dequantized weights instead of the block kernels, and in what
form. A model's build asks once (models/weights.py) and hands the answer to each linear.

    form = many_rows()   # ManyRows(rows=24, bf16=True) on an AVX512-BF16 CPU
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.kernels.bf16_linear import onednn_bf16_available
from shoal.kernels.cpu_features import CpuFeatures, read_cpu_features
from shoal.kernels.cpu_kernels import with_vnni
from shoal.kernels.linear import NEVER

# From this many rows on a step computes more than it reads the weights, and the dequantized
# weights beat the block kernels: on AMX's bfloat16 tiles from 10 rows; in shoal's bfloat16
# panels on AVX512-BF16 from 24 (SmolLM2's 30 layers of distinct weights on the Zen 5 EPYC,
# float32 in and out, 2 threads: 16 rows 6.3-6.9 ms in blocks against 7.1-7.5, 20 rows 7.4-7.6
# against 7.0-7.2, 24 rows 8.4-8.8 against 7.2-7.4, 32 rows 10.8-11.4 against 8.1-9.4, 64 rows
# 21.9 against 17.7; through oneDNN's bfloat16 there once from 64: on the AMD EPYC, 32 rows
# 32.5 ms against 33.7 in blocks, 64 rows 51.5 against 66.1, 256 rows 179 against 265; the
# engine's decode of 16 rows took 35-38 ms a step against 24 with them from 16). The lm_head
# takes the same form from the same rows (a `Bf16Head`: its top logits again in float32); in
# the panels on the Zen 5 EPYC 2.29 ms at 32 rows against 3.27 in blocks, 64 rows 4.25 against
# 6.45, 16 rows 1.71 against 1.70 (through oneDNN it had lost there: 64 rows 23.1 ms against
# 20.3, so it had kept its blocks until 2026-11-29). Without VNNI (an AVX2 build) the float32
# panels from ~32 rows (16 rows 23.7 ms in blocks against 28.1, 32 rows 46.0 against 44.2;
# bench/README.md). With VNNI and no bfloat16 the blocks win at every size measured (256 rows
# 289 ms against 353 for the panels), so they take every step and no panels are kept.
MANY_ROWS_TILES = 10
MANY_ROWS_BF16 = 24
MANY_ROWS_PANELS = 24


@dataclass(frozen=True)
class ManyRows:
    """From how many rows on an int8 linear, the lm_head too, multiplies its dequantized
    weights (NEVER: the blocks take every step), and how: in bfloat16 (oneDNN's tiles, or
    shoal's panels), or in float32 panels."""

    rows: int
    bf16: bool


def many_rows() -> ManyRows:
    """How an int8 linear takes steps of many rows on this CPU (a model's build asks once)."""
    return form_for(read_cpu_features(), onednn_bf16_available(), with_vnni())


def form_for(cpu: CpuFeatures, onednn_bf16: bool, vnni_build: bool) -> ManyRows:
    """The form on a CPU of those features (its AMX and AVX512-BF16 as torch confirms them),
    with oneDNN's bfloat16 or not, and kernels built with VNNI or not."""
    if onednn_bf16 and cpu.amx_bf16:
        return ManyRows(MANY_ROWS_TILES, True)
    if onednn_bf16 and cpu.bf16:
        return ManyRows(MANY_ROWS_BF16, True)
    return ManyRows(NEVER if vnni_build else MANY_ROWS_PANELS, False)
