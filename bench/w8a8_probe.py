"""What an 8-bit-activation (W8A8) linear could do on a CPU with AVX512-VNNI, beside shoal's
bfloat16 panels: a probe, not a kernel shoal runs. The int8 mode's many-row steps multiply in
the bfloat16 panels (`vdpbf16ps`); `vpdpbusd` does twice their multiply-adds a cycle
(`cpu_peak.py`), and activations rounded unsigned per block of 32 beside the GGUF's own weights
keep int8's quality bound (`act8_emulation.py --act-asym`). This measures the kernel side:

  tile    one register tile of 4 rows x 2 panels of 16 channels, its weights in L1, summed over
          SmolLM2's K = 576 again and again: `vpdpbusd` with each block of 32's scales and
          minimum's term applied (a conversion, a multiply and two multiply-adds a row and
          panel every 8 `vpdpbusd`s), against the same tile of `vdpbf16ps`. One thread.
  layers  SmolLM2's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
          in 30 layers of distinct random weights, that tile swept over every panel and row,
          against `bf16_panel_linear` on the same shapes, threads as given.

    python bench/w8a8_probe.py                      # both, 64 and 256 rows, 2 threads
    python bench/w8a8_probe.py --rows 16 64 --layers 1

Prints one line a part (tile), and a row count (layers):
    w8a8_probe part=tile u8_gmacs=<x> bf16_gmacs=<y> u8_over_bf16=<x/y> machine=<desc>
    w8a8_probe part=layers rows=<m> layers=<n> u8_ms=<x> bf16_ms=<y> u8_over_bf16=<y/x>
               max_rel_err=<against a float64 reference> machine=<desc>
(the ms are the best of three passes; u8_over_bf16 above 1 is the probe faster). Needs a
compiler, AVX512-VNNI and AVX512-BF16, and the CPU kernels (cpu_kernels.py) for the panels.
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
from torch.utils.cpp_extension import load_inline

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's [N, K], a layer
_SOURCE = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

// rows 0..3 of x (uint8 [4, K]) times panels 0..1 (int8 [2][B][512]: quad i of block b holds
// 16 channels x 4 of K at 64 i), each block's sums scaled by dw[p][b] * dx[r][b] and the
// block's minimum mx[r][b] times cw[p][b] added: out [4][32] float
inline void u8_tile(const int8_t* w, int64_t w_stride, const float* dw, const float* cw,
                    int64_t s_stride, const uint8_t* x, int64_t K, const float* dx,
                    const float* mx, int64_t B, float* out, int64_t out_stride) {
  __m512 acc[4][2];
  for (int r = 0; r < 4; ++r) for (int q = 0; q < 2; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i dot[4][2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i w0 = _mm512_loadu_si512(w + b * 512 + 64 * i);
      const __m512i w1 = _mm512_loadu_si512(w + w_stride + b * 512 + 64 * i);
      for (int r = 0; r < 4; ++r) {
        int32_t a;
        std::memcpy(&a, x + r * K + b * 32 + 4 * i, 4);
        const __m512i av = _mm512_set1_epi32(a);
        dot[r][0] = _mm512_dpbusd_epi32(i ? dot[r][0] : _mm512_setzero_si512(), av, w0);
        dot[r][1] = _mm512_dpbusd_epi32(i ? dot[r][1] : _mm512_setzero_si512(), av, w1);
      }
    }
    for (int q = 0; q < 2; ++q) {
      const __m512 d = _mm512_loadu_ps(dw + q * s_stride + b * 16);
      const __m512 c = _mm512_loadu_ps(cw + q * s_stride + b * 16);
      for (int r = 0; r < 4; ++r) {
        const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][q]), d);
        acc[r][q] = _mm512_fmadd_ps(p, _mm512_set1_ps(dx[r * B + b]), acc[r][q]);
        acc[r][q] = _mm512_fmadd_ps(c, _mm512_set1_ps(mx[r * B + b]), acc[r][q]);
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(out + r * out_stride + 16 * q, acc[r][q]);
}

// the same tile in bfloat16: x [4][K] bfloat16 pairs, panels [2][K / 2][32] (pair i: 16
// channels x 2 of K), products summed in float32
inline void bf16_tile(const uint16_t* w, int64_t w_stride, const uint16_t* x, int64_t K,
                      float* out) {
  __m512 acc[4][2];
  for (int r = 0; r < 4; ++r) for (int q = 0; q < 2; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K / 2; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 32 * i);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + w_stride + 32 * i);
    for (int r = 0; r < 4; ++r) {
      int32_t a;
      std::memcpy(&a, x + r * K + 2 * i, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, w1);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(out + 32 * r + 16 * q, acc[r][q]);
}

}  // namespace

// y [M, N] = the W8A8 product: xq uint8 [M, K], dx, mx float [M, B]; w int8 [P, B, 512];
// dw, cw float [P, B, 16]. M a multiple of 4, P of 2.
void u8_linear(at::Tensor xq, at::Tensor dx, at::Tensor mx, at::Tensor w, at::Tensor dw,
               at::Tensor cw, at::Tensor y) {
  const int64_t M = xq.size(0), K = xq.size(1), P = w.size(0), B = w.size(1), N = y.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* dwp = dw.data_ptr<float>();
  const float* cwp = cw.data_ptr<float>();
  const uint8_t* x = xq.data_ptr<uint8_t>();
  const float* dxp = dx.data_ptr<float>();
  const float* mxp = mx.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, P / 2, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m = 0; m < M; m += 4) {
        u8_tile(wp + 2 * g * B * 512, B * 512, dwp + 2 * g * B * 16, cwp + 2 * g * B * 16, B * 16,
                x + m * K, K, dxp + m * B, mxp + m * B, B, out + m * N + 32 * g, N);
      }
    }
  });
}

// seconds for `reps` passes of each tile over K = 576 with its operands in L1 (one thread)
std::vector<double> tile_seconds(int64_t reps) {
  constexpr int64_t K = 576, B = K / 32;
  std::vector<int8_t> w(2 * B * 512);
  std::vector<uint16_t> wb(2 * K * 16), xb(4 * K);
  std::vector<uint8_t> x(4 * K);
  std::vector<float> s(2 * B * 16, 0.5f), dx(4 * B, 0.25f), out(4 * 32);
  for (size_t i = 0; i < w.size(); ++i) w[i] = int8_t(i * 7 % 127);
  for (size_t i = 0; i < x.size(); ++i) x[i] = uint8_t(i * 3 % 200);
  for (size_t i = 0; i < wb.size(); ++i) wb[i] = uint16_t(0x3f80 + i % 64);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = uint16_t(0x3f00 + i % 64);
  float sink = 0.f;
  auto start = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < reps; ++t) {
    u8_tile(w.data(), B * 512, s.data(), s.data(), B * 16, x.data(), K, dx.data(), dx.data(), B,
            out.data(), 32);
    sink += out[t % 128];
  }
  auto mid = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < reps; ++t) {
    bf16_tile(wb.data(), K * 16, xb.data(), K, out.data());
    sink += out[t % 128];
  }
  auto end = std::chrono::steady_clock::now();
  return {std::chrono::duration<double>(mid - start).count(),
          std::chrono::duration<double>(end - mid).count(), double(sink)};
}
"""


def build(folder: Path) -> Any:
    return load_inline(
        name="shoal_w8a8_probe",
        cpp_sources="#include <chrono>\n#include <vector>\n" + _SOURCE,
        functions=["u8_linear", "tile_seconds"],
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16"],
        build_directory=str(folder),
    )


def quantized(n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random int8 weights in the probe's quads with their block scales, and the same weight in
    bfloat16 panels."""
    from shoal.kernels.bf16_linear import pack_bf16_panels

    q = torch.randint(-127, 128, (n // 16, k // 32, 512), dtype=torch.int8, generator=gen)
    dw = torch.rand(n // 16, k // 32, 16, generator=gen) / 64
    cw = torch.rand(n // 16, k // 32, 16, generator=gen)
    dense = q.view(n // 16, k // 32, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k // 32, 32)
    weight = (dense.float() * dw.permute(0, 2, 1).reshape(n, k // 32, 1)).reshape(n, k)
    return {"q": q, "dw": dw, "cw": cw, "dense": dense, "panels": pack_bf16_panels(weight)}


def reference(
    xq: torch.Tensor, dx: torch.Tensor, mx: torch.Tensor, w: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The probe's product in float64: sum_b dx dw (xq . q) + mx cw."""
    n, blocks = w["dense"].shape[0], w["dense"].shape[1]
    dots = torch.einsum("mbk,nbk->mnb", xq.view(xq.shape[0], blocks, 32).double(),
                        w["dense"].double())  # fmt: skip
    dw = w["dw"].permute(0, 2, 1).reshape(n, blocks).double()
    cw = w["cw"].permute(0, 2, 1).reshape(n, blocks).double()
    return (dots * dx.double()[:, None] * dw[None]).sum(-1) + mx.double() @ cw.T


def best_ms(run: Callable[[], None]) -> float:
    run()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layers_line(probe: Any, rows: int, layers: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    weights = [[quantized(n, k, gen) for n, k in SHAPES] for _ in range(layers)]
    inputs = {}
    for _, k in SHAPES:
        xq = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen)
        dx, mx = torch.rand(rows, k // 32, generator=gen), torch.rand(rows, k // 32, generator=gen)
        inputs[k] = (xq, dx, mx, torch.randn(rows, k, generator=gen))
    outs = {n: torch.empty(rows, n) for n, _ in SHAPES}
    first, (n0, k0) = weights[0][0], SHAPES[0]
    probe.u8_linear(*inputs[k0][:3], first["q"], first["dw"], first["cw"], outs[n0])
    want = reference(*inputs[k0][:3], first)
    err = float(((outs[n0].double() - want).abs().max() / want.abs().max()).item())

    def u8() -> None:
        for layer in weights:
            for (n, k), w in zip(SHAPES, layer, strict=True):
                probe.u8_linear(*inputs[k][:3], w["q"], w["dw"], w["cw"], outs[n])

    def bf16() -> None:
        for layer in weights:
            for (n, k), w in zip(SHAPES, layer, strict=True):
                torch.ops.shoal_cpu.bf16_panel_linear(inputs[k][3], w["panels"], None, outs[n])

    u8_ms, bf16_ms = best_ms(u8), best_ms(bf16)
    return {"part": "layers", "rows": rows, "layers": layers, "u8_ms": round(u8_ms, 2),
            "bf16_ms": round(bf16_ms, 2), "u8_over_bf16": round(bf16_ms / u8_ms, 2),
            "max_rel_err": f"{err:.1e}"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="multiples of 4")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200_000, help="tile passes (the tile part)")
    parser.add_argument("--out", type=Path, help="append each line as JSON")
    args = parser.parse_args(argv)
    from shoal.kernels.cpu_features import read_cpu_features
    from shoal.kernels.cpu_kernels import load_cpu_kernels
    from shoal.loading.loader import default_cache_dir

    cpu = read_cpu_features()
    if not (cpu.vnni and cpu.bf16):
        print(f"w8a8_probe skipped: needs AVX512-VNNI and AVX512-BF16 ({cpu.isa()})", flush=True)
        return 0
    own_threads = torch.get_num_threads()
    load_cpu_kernels(default_cache_dir())
    with tempfile.TemporaryDirectory() as folder:
        probe = build(Path(folder))
        u8_s, bf16_s, _ = probe.tile_seconds(args.reps)
        macs = args.reps * 4 * 32 * 576  # 4 rows x 32 channels x K
        u8, bf16 = macs / u8_s / 1e9, macs / bf16_s / 1e9
        tile = {"part": "tile", "u8_gmacs": round(u8, 1), "bf16_gmacs": round(bf16, 1)}
        emit("w8a8_probe", {**tile, "u8_over_bf16": round(u8 / bf16, 2), "machine": machine()},
             args.out)  # fmt: skip
        torch.set_num_threads(args.threads)
        for rows in args.rows:
            line = layers_line(probe, rows, args.layers)
            emit("w8a8_probe", {**line, "machine": machine()}, args.out)
    torch.set_num_threads(own_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
