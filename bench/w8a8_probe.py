"""What int8's many-row steps could do with 8-bit activations on a CPU with AVX512-VNNI and no
AMX, beside the kernels they run now: a probe (bench/w8a8_probe.cpp), not a kernel shoal runs.
On such a CPU the int8 mode multiplies few rows in its blocks (`q4_linear`, int16 activations,
`vpdpwssd`) and many in bfloat16 panels (`bf16_panel_linear`, `vdpbf16ps`); `vpdpbusd` does
twice `vdpbf16ps`' multiply-adds a cycle (`cpu_peak.py`), and activations rounded unsigned per
block of 32 beside the GGUF's own weights keep int8's quality bound
(`act8_emulation.py --act-asym`). Two parts:

  tile    one register tile of 4 rows x 2 panels of 16 channels, its operands in L1, summed over
          SmolLM2's K = 576 again and again: `vpdpbusd` with each block of 32's scale and
          the activations' minimum applied, against the same tile of `vdpbf16ps`. One thread.
  layers  SmolLM2's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
          in 30 layers of distinct Q4_1 weights (as the bundled GGUF holds them), float32 rows
          in and out: `u8_linear` (the rows rounded to unsigned 8 bits a block of 32, the
          weights' own 4-bit integers, a tile of 4 rows x 2 panels applying both scales and
          both minimums every block) against the blocks and the bfloat16 panels.

    python bench/w8a8_probe.py                      # rows 16 32 64 256, 2 threads
    python bench/w8a8_probe.py --rows 64 --layers 1

Prints one line a part (tile), and a row count (layers):
    w8a8_probe part=tile u8_gmacs=<x> bf16_gmacs=<y> u8_over_bf16=<x/y> machine=<desc>
    w8a8_probe part=layers rows=<m> layers=<n> u8_ms=<x> bf16_panels_ms=<y> blocks_ms=<z>
               u8_over_bf16=<y/x> max_rel_err=<against a float64 reference> machine=<desc>
(the ms are the best of five passes; u8_over_bf16 above 1 is the probe faster). Needs a
compiler, AVX512-VNNI and AVX512-BF16, and the CPU kernels (cpu_kernels.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_format import emit, machine
from torch.utils.cpp_extension import load

from shoal.kernels.quant import BLOCK, PANEL, Q4Blocks, Q8Blocks, exact_q4_blocks

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's [N, K], a layer
SOURCE = Path(__file__).resolve().parent / "w8a8_probe.cpp"
CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"  # tiles.h
BLOCK_BYTES = 704  # 512 bytes of quads, then dw, cw and mw, 16 float32 each


def load_probe() -> None:
    """shoal's CPU kernels (the panels and blocks it is measured against) and the probe's ops
    (torch.ops.shoal_probe), compiled once a process."""
    from shoal.kernels.cpu_kernels import load_cpu_kernels
    from shoal.loading.loader import default_cache_dir

    load_cpu_kernels(default_cache_dir())
    if hasattr(torch.ops.shoal_probe, "u8_linear"):
        return
    with tempfile.TemporaryDirectory() as folder:
        load(
            name="shoal_w8a8_probe",
            sources=[str(SOURCE)],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3", "-fopenmp"],  # at::parallel_for is OpenMP's: else one thread
            extra_ldflags=["-fopenmp"],
            build_directory=folder,
            is_python_module=False,
        )


def pack_u8_panels(blocks: Q4Blocks | Q8Blocks) -> torch.Tensor:
    """The blocks' weights as uint8 [P, B, 704]: panel p's block b holds channel 16 p + j's
    integer weight at K = 32 b + 4 i + t in byte 64 i + 4 j + t, then float32 dw (the block's
    scale), cw (dw times the sum of its integers) and mw (its minimum: Q4_1's m, 0 for int8)
    for the 16 channels; w = dw * q + mw. Channels past N are zero."""
    values = blocks.values()  # [N, B * 32]: int8, or Q4's 0..15 as uint8
    n, k = values.shape
    panels, count = -(-n // PANEL), k // BLOCK
    q = torch.zeros(panels * PANEL, k, dtype=torch.int8)
    q[:n] = values.to(torch.int8)
    quads = q.view(panels, PANEL, count, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    dw = blocks.d  # [P, B, 16]
    sums = q.view(panels, PANEL, count, BLOCK).sum(-1, dtype=torch.int32).permute(0, 2, 1)
    mw = blocks.m if isinstance(blocks, Q4Blocks) else torch.zeros_like(dw)
    scales = torch.stack([dw, dw * sums.float(), mw], dim=2).contiguous()  # [P, B, 3, 16]
    packed = torch.empty(panels, count, BLOCK_BYTES, dtype=torch.uint8)
    packed[:, :, :512] = quads.reshape(panels, count, 512).view(torch.uint8)
    packed[:, :, 512:] = scales.view(panels, count, 48).view(torch.uint8)
    return packed


def u8_product(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    torch.ops.shoal_probe.u8_linear(x, panels, bias, out)
    return out


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's blocks of 32 as u8_linear rounds them (255 steps from the block's minimum),
    in float64."""
    g = x.float().reshape(x.shape[0], -1, BLOCK)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(lo))
    u = torch.round((g - lo) / step).clamp(0, 255)
    return (u.double() * step.double() + lo.double()).reshape(x.shape)


def q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight that is exactly Q4_1 blocks (q * d + m, d a float16), as the GGUF's are."""
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen).float()
    q[:, :, 0], q[:, :, 1] = 0, 15  # each block's minimum and maximum, as GGUF's quantizer puts
    d = (torch.rand(n, k // BLOCK, 1, generator=gen) / 50 + 1e-3).half().float()
    m = -torch.rand(n, k // BLOCK, 1, generator=gen) / 10
    return (q * d + m).reshape(n, k)


def best_ms(run: Callable[[], None]) -> float:
    run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layers_line(rows: int, layers: int) -> dict[str, object]:
    from shoal.kernels.bf16_linear import pack_bf16_panels

    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(layers):
        layer = []
        for n, k in SHAPES:
            blocks = exact_q4_blocks(q4_weight(n, k, gen))
            assert blocks is not None
            layer.append((blocks, pack_u8_panels(blocks), pack_bf16_panels(blocks.dequantize())))
        weights.append(layer)
    x = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
    outs = {n: torch.empty(rows, n) for n, _ in SHAPES}
    blocks, panels, _ = weights[0][0]
    want = rounded_rows(x[SHAPES[0][1]]) @ blocks.dequantize().double().T
    got = u8_product(x[SHAPES[0][1]], panels, SHAPES[0][0]).double()
    err = float(((got - want).abs().max() / want.abs().max()).item())

    Multiply = Callable[[torch.Tensor, tuple[Any, ...], torch.Tensor], None]

    def sweep(multiply: Multiply) -> Callable[[], None]:
        """Every layer's four projections, each as `multiply` takes (x, its parts, out)."""

        def run() -> None:
            for layer in weights:
                for (n, k), parts in zip(SHAPES, layer, strict=True):
                    multiply(x[k], parts, outs[n])

        return run

    ops = torch.ops
    u8 = best_ms(sweep(lambda x, p, out: ops.shoal_probe.u8_linear(x, p[1], None, out)))
    bf16 = best_ms(sweep(lambda x, p, out: ops.shoal_cpu.bf16_panel_linear(x, p[2], None, out)))
    int16 = best_ms(sweep(lambda x, p, out: p[0].run(x, None, out)))
    return {"part": "layers", "rows": rows, "layers": layers, "u8_ms": round(u8, 2),
            "bf16_panels_ms": round(bf16, 2), "blocks_ms": round(int16, 2),
            "u8_over_bf16": round(bf16 / u8, 2), "max_rel_err": f"{err:.1e}"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 256])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200_000, help="tile passes (the tile part)")
    parser.add_argument("--out", type=Path, help="append each line as JSON")
    args = parser.parse_args(argv)
    from shoal.kernels.cpu_features import read_cpu_features

    cpu = read_cpu_features()
    if not (cpu.vnni and cpu.bf16):
        print(f"w8a8_probe skipped: needs AVX512-VNNI and AVX512-BF16 ({cpu.isa()})", flush=True)
        return 0
    own_threads = torch.get_num_threads()
    load_probe()
    u8_s, bf16_s, _ = torch.ops.shoal_probe.tile_seconds(args.reps)
    macs = args.reps * 4 * 32 * 576  # 4 rows x 32 channels x K
    u8, bf16 = macs / u8_s / 1e9, macs / bf16_s / 1e9
    tile = {"part": "tile", "u8_gmacs": round(u8, 1), "bf16_gmacs": round(bf16, 1)}
    emit("w8a8_probe", {**tile, "u8_over_bf16": round(u8 / bf16, 2), "machine": machine()},
         args.out)  # fmt: skip
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        emit("w8a8_probe", {**layers_line(rows, args.layers), "machine": machine()}, args.out)
    torch.set_num_threads(own_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
