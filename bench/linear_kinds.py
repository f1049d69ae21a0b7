"""The CPU's matmuls at a model's shapes, each way shoal could run them (issue 32): shoal's
float32 panels (`f32_linear`, csrc/linear.cpp), oneDNN's packed float32 (what PackedLinear
falls back to), `F.linear` (MKL's sgemm), oneDNN's packed bfloat16 (AMX where the CPU has
it), shoal's bfloat16 panels (`bf16_panel_linear`, csrc/bf16_panels.cpp, where the CPU has
AVX512-BF16; x given in float32, rounded there), and int8's blocks (`q4_linear` for the
projections, as the bundled SmolLM2's Q4_1 weights are kept, `q8_linear` for the lm_head;
csrc/block_linear.cpp). One line per row count:
a whole decoder's projections (each layer's qkv, o, gate_up and down, times the layer count)
and the lm_head, in milliseconds.

    python bench/linear_kinds.py                          # SmolLM2-135M's shapes, 1 16 64 256
    python bench/linear_kinds.py --rows 1 16 --repeats 20 --out bench/linear_kinds.jsonl

    linear_kinds part=<layers|lm_head> rows=<M> panels_ms=<x> onednn_ms=<x> f_linear_ms=<x>
        onednn_bf16_ms=<x> bf16_panels_ms=<x> int8_blocks_ms=<x> isa=<flags> machine=<desc>

The weights are random (the time does not depend on their values); the panels need the
compiled CPU kernels (without them that column is absent), and a CPU whose oneDNN has no
bfloat16 (AVX2 alone) has no onednn_bf16 column.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_format import emit, machine

from shoal.kernels.bf16_linear import onednn_bf16_available, pack_bf16_panels
from shoal.kernels.cpu_features import read_cpu_features
from shoal.kernels.cpu_kernels import KernelUnavailable, load_cpu_kernels
from shoal.kernels.linear import pack_panels
from shoal.kernels.quant import BLOCK, exact_q4_blocks, q8_blocks
from shoal.loading.loader import default_cache_dir

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, 30 layers
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LAYERS = 30
HEAD_SHAPE = (49152, 576)


def q4_1_weight(out_features: int, in_features: int) -> torch.Tensor:
    """A random weight that Q4_1 gives back exactly (q in 0 .. 15, 0 and 15 in every block,
    a float16 scale), as the bundled SmolLM2's projections are."""
    q = torch.randint(0, 16, (out_features, in_features // BLOCK, BLOCK)).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, in_features // BLOCK, 1) * 0.01).half().float()
    return (q * d - 0.05).view(out_features, in_features)


def runner(
    kind: str, weight: torch.Tensor, x: torch.Tensor, head: bool
) -> Callable[[], object] | None:
    rows = int(x.shape[0])
    if kind == "int8_blocks":
        if not hasattr(torch.ops.shoal_cpu, "q4_linear"):
            return None
        blocks = q8_blocks(weight) if head else exact_q4_blocks(q4_1_weight(*weight.shape))
        assert blocks is not None
        y = torch.empty(rows, weight.shape[0])
        return lambda: blocks.run(x, None, y)
    if kind == "bf16_panels":
        ops = torch.ops.shoal_cpu
        if not hasattr(ops, "bf16_panel_linear") or not ops.bf16_panels_supported():
            return None
        bf16, out = pack_bf16_panels(weight), torch.empty(rows, weight.shape[0])
        return lambda: ops.bf16_panel_linear(x, bf16, None, out)
    if kind == "panels":
        if not hasattr(torch.ops.shoal_cpu, "f32_linear"):
            return None
        panels, y = pack_panels(weight), torch.empty(rows, weight.shape[0])
        return lambda: torch.ops.shoal_cpu.f32_linear(x, panels, None, y)
    if kind == "f_linear":
        return lambda: torch.nn.functional.linear(x, weight)
    if kind == "onednn_bf16":
        if not onednn_bf16_available():  # AVX2 alone: oneDNN refuses to pack bfloat16
            return None
        weight, x = weight.to(torch.bfloat16), x.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm: first-call setup out of the timing
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - began) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    with contextlib.suppress(KernelUnavailable):  # no compiler: no panels column
        load_cpu_kernels(default_cache_dir())
    parts = {"layers": (LAYER_SHAPES, LAYERS), "lm_head": ([HEAD_SHAPE], 1)}
    for part, (shapes, times) in parts.items():
        for rows in args.rows:
            line: dict[str, object] = {"part": part, "rows": rows}
            kinds = ("panels", "onednn", "f_linear", "onednn_bf16", "bf16_panels", "int8_blocks")
            for kind in kinds:
                total, ran = 0.0, True
                for out_features, in_features in shapes:
                    weight = torch.randn(out_features, in_features)
                    run = runner(kind, weight, torch.randn(rows, in_features), part == "lm_head")
                    if run is None:
                        ran = False
                        break
                    total += seconds(run, args.repeats) * times
                if ran:
                    line[f"{kind}_ms"] = round(total * 1e3, 2)
            line["isa"], line["machine"] = read_cpu_features().isa(), machine()
            emit("linear_kinds", line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
