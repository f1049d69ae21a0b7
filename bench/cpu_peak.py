"""The CPU's multiply-add ceiling: how many multiply-adds a second its vector units can do in
float32 and in 8-bit integers, with no memory traffic at all. The figure any CPU kernel here is
held against (docs/cpu-step.md), and the bound on what an int8 matmul can gain over float32.

    python bench/cpu_peak.py                    # 1 and 2 threads, AVX2
    python bench/cpu_peak.py --threads 2 --iters 20000000

Each thread runs twelve independent chains (enough to hide every latency) of
    float32   vfmadd: 8 multiply-adds an instruction
    int8      vpmaddubsw (32 u8 x s8 products, pairs summed to s16), vpmaddwd by ones (to s32),
              vpaddd into the accumulator: 32 multiply-adds for three instructions, the fastest
              exact int8 sum AVX2 has without VNNI
and, where the CPU has them (`-` where not), the same twelve chains of 512-bit instructions:
    zmm_f32   vfmadd on 16 floats
    bf16_dot  vdpbf16ps (AVX512-BF16): 32 multiply-adds of bfloat16 pairs into float32
    vnni_u8   vpdpbusd (AVX512-VNNI): 64 u8 x s8 multiply-adds into int32, the instruction an
              8-bit-activation kernel would sum with
so that vnni_over_bf16 says what such a kernel could gain over the bfloat16 panels at most.
One line per thread count:
    cpu_peak threads=<n> f32_gmacs=<x> f32_gflops=<2x> int8_gmacs=<y> int8_over_f32=<y/x>
             zmm_f32_gmacs=<a|-> bf16_dot_gmacs=<b|-> vnni_u8_gmacs=<c|-> vnni_over_bf16=<c/b|->
             machine=<desc>
Needs a compiler (torch's extension builder, as the CPU kernels do) and AVX2.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_format import emit, machine
from torch.utils.cpp_extension import load

from shoal.kernels.cpu_features import read_cpu_features

CHAINS = 12
CHAIN_NAMES = ("f32_chains", "int8_chains", "zmm_f32_chains", "bf16_dot_chains", "vnni_u8_chains")
_SOURCE = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>

// Each returns a value that depends on every chain, so nothing is optimized away. C functions
// (ctypes calls them): no Python binding, whose headers took most of a 50 s compile.
extern "C" double f32_chains(int64_t iters) {
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m256 acc[12];
      for (int c = 0; c < 12; ++c) acc[c] = _mm256_set1_ps(float(c));
      __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
      for (int64_t i = 0; i < iters; ++i) {
        for (int c = 0; c < 12; ++c) acc[c] = _mm256_fmadd_ps(acc[c], x, y);
        asm volatile("" : "+x"(x));
      }
      float f[8];
      __m256 s = acc[0];
      for (int c = 1; c < 12; ++c) s = _mm256_add_ps(s, acc[c]);
      _mm256_storeu_ps(f, s);
      sink += int64_t(f[0]);
    }
  });
  return double(sink);
}

extern "C" double int8_chains(int64_t iters) {
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m256i acc[12], a[6];
      for (int c = 0; c < 12; ++c) acc[c] = _mm256_set1_epi32(c);
      for (int c = 0; c < 6; ++c) a[c] = _mm256_set1_epi8(char(7 + 2 * c));
      __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(-5);
      const __m256i ones = _mm256_set1_epi16(1);
      auto step = [&](__m256i sum, __m256i x, __m256i w) {
        return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones));
      };
      for (int64_t i = 0; i < iters; ++i) {
        for (int c = 0; c < 6; ++c) {
          acc[c] = step(acc[c], a[c], w0);
          acc[c + 6] = step(acc[c + 6], a[c], w1);
        }
        asm volatile("" : "+x"(w0), "+x"(w1));
      }
      int32_t f[8];
      __m256i s = acc[0];
      for (int c = 1; c < 12; ++c) s = _mm256_add_epi32(s, acc[c]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(f), s);
      sink += f[0];
    }
  });
  return double(sink);
}

// Twelve chains of one 512-bit multiply-add instruction (Op: 0 vfmadd, 1 vdpbf16ps,
// 2 vpdpbusd), compiled for those extensions alone: called only where the CPU has them.
#define SHOAL_ZMM __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vnni")))
template <int Op>
SHOAL_ZMM int64_t zmm_thread(int64_t iters) {
  __m512 f[12];
  __m512i s[12];
  for (int c = 0; c < 12; ++c) f[c] = _mm512_set1_ps(float(c));
  for (int c = 0; c < 12; ++c) s[c] = _mm512_set1_epi32(c);
  __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  __m512i a = _mm512_set1_epi8(3), w = _mm512_set1_epi8(-5);
  for (int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < 12; ++c) {
      if constexpr (Op == 0) f[c] = _mm512_fmadd_ps(f[c], x, y);
      if constexpr (Op == 1) f[c] = _mm512_dpbf16_ps(f[c], (__m512bh)a, (__m512bh)w);
      if constexpr (Op == 2) s[c] = _mm512_dpbusd_epi32(s[c], a, w);
    }
    asm volatile("" : "+v"(x), "+v"(a));
  }
  __m512 fs = f[0];
  __m512i is = s[0];
  for (int c = 1; c < 12; ++c) fs = _mm512_add_ps(fs, f[c]);
  for (int c = 1; c < 12; ++c) is = _mm512_add_epi32(is, s[c]);
  return int64_t(_mm512_reduce_add_ps(fs)) + _mm512_reduce_add_epi32(is);
}

template <int Op>
double zmm_chains(int64_t iters) {
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink += zmm_thread<Op>(iters);
  });
  return double(sink);
}

extern "C" double zmm_f32_chains(int64_t iters) { return zmm_chains<0>(iters); }
extern "C" double bf16_dot_chains(int64_t iters) { return zmm_chains<1>(iters); }
extern "C" double vnni_u8_chains(int64_t iters) { return zmm_chains<2>(iters); }
"""


def build(folder: Path) -> ctypes.CDLL:
    """The chains compiled into `folder` (torch's builder, linked to torch for its threads)."""
    source = folder / "shoal_cpu_peak.cpp"
    source.write_text(_SOURCE)
    library = load(
        name="shoal_cpu_peak",
        sources=[str(source)],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    peak = ctypes.CDLL(str(library))
    for chain in CHAIN_NAMES:
        function = getattr(peak, chain)
        function.restype, function.argtypes = ctypes.c_double, [ctypes.c_int64]
    return peak


def rate(run: Callable[[int], float], iters: int, per_chain_step: int, threads: int) -> float:
    """Multiply-adds a second, in billions, the best of three runs."""
    run(1000)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run(iters)
        best = min(best, time.perf_counter() - start)
    return threads * iters * CHAINS * per_chain_step / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=20_000_000, help="chain steps a thread")
    parser.add_argument("--out", type=Path, help="append each line as JSON")
    args = parser.parse_args(argv)
    own_threads = torch.get_num_threads()
    cpu = read_cpu_features()
    zmm = {  # name: (chain, multiply-adds an instruction, whether this CPU has it)
        "zmm_f32": ("zmm_f32_chains", 16, "avx512f" in cpu.flags),
        "bf16_dot": ("bf16_dot_chains", 32, cpu.bf16),
        "vnni_u8": ("vnni_u8_chains", 64, cpu.vnni),
    }
    with tempfile.TemporaryDirectory() as folder:
        peak = build(Path(folder))
        for threads in args.threads:
            torch.set_num_threads(threads)
            f32 = rate(peak.f32_chains, args.iters, 8, threads)
            int8 = rate(peak.int8_chains, args.iters, 32, threads)
            line: dict[str, object] = {
                "threads": threads,
                "f32_gmacs": round(f32, 1),
                "f32_gflops": round(2 * f32, 1),
                "int8_gmacs": round(int8, 1),
                "int8_over_f32": round(int8 / f32, 2),
            }
            wide: dict[str, float] = {}
            for name, (chain, macs, present) in zmm.items():
                if present:
                    wide[name] = rate(getattr(peak, chain), args.iters, macs, threads)
                line[f"{name}_gmacs"] = round(wide[name], 1) if name in wide else "-"
            both = "bf16_dot" in wide and "vnni_u8" in wide
            line["vnni_over_bf16"] = round(wide["vnni_u8"] / wide["bf16_dot"], 2) if both else "-"
            line["machine"] = machine()
            emit("cpu_peak", line, args.out)
    torch.set_num_threads(own_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
