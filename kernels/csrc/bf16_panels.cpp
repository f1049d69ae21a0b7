// A bfloat16 linear over weights packed once in panels of 16 output channels, multiplied by
// AVX512-BF16's dot products (`vdpbf16ps`), for `dtype="bfloat16"` on a CPU that has them and
// no AMX tiles (bf16_linear.py):
//
//   bf16_panel_linear(x, panels, bias, out)
//       x       [M, K] float32 (rounded to bfloat16 here, nearest even, as torch's .to()) or
//               bfloat16, rows contiguous; K even
//       panels  [ceil(N / 16), K / 2, 32] bfloat16, contiguous (bf16_linear.pack_bf16_panels):
//               panels[p, i] = w[16 p + j, 2 i + h] at 2 j + h, channels past N zero
//       bias    [N] float32 or None
//       out     [M, N] float32, rows contiguous: x w.T + bias
//
//   bf16_silu_mul(x, panels, out)
//       x       as above
//       panels  [ceil(I / 8), K / 2, 32] bfloat16 (bf16_gated.pack_gated_bf16_panels): a SiLU-
//               gated MLP's gate_up [2I, K], panel p's 16 channels gate 8p .. 8p + 7, then the
//               same up channels (past I: zeros)
//       out     [M, I] bfloat16, rows contiguous: silu(gate) * up, each channel as
//               elementwise.cpp's silu_mul computes it from this op's float32 sums (silu.h), then
//               rounded to nearest even, as the next call's rounding of x would: the bits of the
//               plain product, silu_mul and the down's rounding, without writing the [M, 2I]
//               float32 product and reading it back twice
//
// A panel's pair i is one zmm: 16 channels x the two weights of K's pair i. One `vdpbf16ps`
// of it against the row's pair broadcast adds both products to the 16 channels' float32 sums:
// a row costs one instruction a pair and 16 channels, nothing to scale or convert after, and
// the product is never rounded to bfloat16 (oneDNN's is). A tile is 3 panels (48 channels) and
// up to 8 rows: 24 independent sums, each pair's three weight vectors loaded once for the 8
// rows and each row's pair broadcast once for the 3 panels; threads split the panels' groups. A
// row's sums are the same whatever rows share its tile or thread (each row its own
// accumulator, K in order), so a row's logits do not depend on the step it is in.
//
// Against oneDNN's bfloat16 matmul (`mkldnn::_linear_pointwise`, AVX512-BF16 without AMX) on
// the 2-core AMD EPYC (Zen 4) of bench/README.md, one panel a tile then, SmolLM2's 30 layers
// from memory, float32 in and out: 1 row 7.1-9.4 ms against 13.4-14.3, 16 rows 12.1-16.9
// against 16.5-19.3, 64 rows 36.5-46.4 against 42.0-49.4; from cache (bench/linear_kinds.py)
// level from 256 rows to 1024. On a Zen 5 EPYC (two 512-bit dot products a cycle) one panel's 8
// sums could not keep its units busy: from cache, 64 rows 23.1 ms against oneDNN's 16.7, 256
// rows 84.7 against 55.7; three panels a tile 16.1 and 57.7 (1 row 2.61 -> 1.82 ms, 16 rows
// 6.25 -> 4.33; two panels 15.8 and 59.6, four at 6 rows 16.6 and 61.4).
//
// A group's first tile reads its panels from memory, the tiles after it from L2; over those,
// each asks for a share of the thread's next group's lines into L2 (`Ahead`, as panels.h does
// for float32), so that its first tile finds them there. 30 layers' distinct weights at 16 rows
// 6.2-6.5 ms against 6.9-7.2, at 64 rows 15.4 against 16.5-17.2, at 256 rows 55.4 against
// 56.9-58.0 (Zen 5 EPYC, 2 threads, alternating builds).
//
// Gated panels (bf16_silu_mul) take two panels a tile, so that their act channels fill one
// vector of 16 (three measured no faster); the epilogue computes the act from the registers.
//
// The dot products are compiled for AVX512-BF16 by a function target and taken only where the
// CPU has it (cpuid): elsewhere the op refuses, and bf16_linear.py never packs panels there.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "silu.h"
#include "tiles.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define SHOAL_BF16_DOTS 1
#endif

namespace {

constexpr int64_t kWidth = 16;     // output channels a panel
constexpr int64_t kGatedWidth = kWidth / 2;  // a gated panel: 8 gates, then their 8 ups
constexpr int64_t kTilePanels = 3;  // panels a tile
constexpr int64_t kTileGatedPanels = 2;  // gated panels a tile: their act channels one vector
constexpr int kTileRows = 8;  // rows a tile: 8 x 3 accumulators
constexpr int64_t kAhead = 1024;   // bytes of a panel asked for ahead
constexpr int64_t kKeptCopy = int64_t{8} << 20;  // bytes of x in bfloat16 a thread keeps

#ifdef SHOAL_BF16_DOTS

#define SHOAL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16_dots() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax & (1u << 5)) != 0;  // AVX512_BF16
}

// Where a tile's sums go: `out` [M, n] float32 (plus the bias), or gated (`gated_out` [M, n]
// bfloat16, n the MLP's I: panel p's act channels 8p .. 8p + 7).
struct Dest {
  const float* bias;
  float* out;
  uint16_t* gated_out;
  int64_t stride;  // elements from a row of the destination to the next
  int64_t n;
};

// v rounded to bfloat16 bits, nearest even: c10's round_to_nearest_even (the rounding of
// ATen's conversion of x at the next call) on 16 lanes, a NaN as its 0x7FC0.
SHOAL_BF16_TARGET inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// One row's act channels of `panels` (1 or 2) gated panels p, p + 1 (a, b: each its 8 gate
// sums, then its 8 ups; b unused with one) into dst[8p ..] in bfloat16: silu(gate) * up as
// elementwise.cpp's silu_mul computes each channel (silu.h: in vector lanes below the row's
// last whole vector, where each lane's value is the same whatever shares its vector; one by
// one past it), then rounded to nearest even; channels past n left alone.
SHOAL_BF16_TARGET void store_gated(__m512 a, __m512 b, int64_t panels, uint16_t* dst,
                                   int64_t p, int64_t n) {
  using shoal_silu::Vec;
  const int64_t c0 = p * kGatedWidth, cols = std::min(panels * kGatedWidth, n - c0);
  const int64_t vector_end = n / Vec::size() * Vec::size();
  const __m512 gates = _mm512_shuffle_f32x4(a, b, 0x44);  // a's 8 gates, b's 8
  const __m512 ups = _mm512_shuffle_f32x4(a, b, 0xEE);    // a's 8 ups, b's 8
#if defined(CPU_CAPABILITY_AVX512)
  __m512 act = shoal_silu::silu_mul(Vec(gates), Vec(ups));
#else
  // A build whose vectors are narrower than the tile's 16 lanes (AVX2's 8; this code runs
  // where the CPU has AVX512-BF16 whatever the build): silu_mul a vector at a time, as that
  // build's elementwise.cpp computes it
  __m512 act;
  {
    alignas(64) float g[16], u[16], y[16];
    _mm512_store_ps(g, gates);
    _mm512_store_ps(u, ups);
    for (int64_t i = 0; i < 16; i += Vec::size()) {
      shoal_silu::silu_mul(Vec::loadu(g + i), Vec::loadu(u + i)).store(y + i);
    }
    act = _mm512_load_ps(y);
  }
#endif
  if (c0 + cols > vector_end) {  // the channels past the row's last whole vector: one by one
    alignas(64) float g[16], u[16], y[16];
    _mm512_store_ps(g, gates);
    _mm512_store_ps(u, ups);
    _mm512_store_ps(y, act);
    for (int64_t c = std::max<int64_t>(0, vector_end - c0); c < cols; ++c) {
      y[c] = shoal_silu::silu_mul(g[c], u[c]);
    }
    act = _mm512_load_ps(y);
  }
  const __m256i bits = bf16_bits(act);
  if (cols == 2 * kGatedWidth) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c0), bits);
  } else {
    _mm256_mask_storeu_epi16(dst + c0, static_cast<__mmask16>((1u << cols) - 1), bits);
  }
}

// Lines of the panels that follow a tile's to ask for from memory into L2 over its pairs, so
// that the next group's first tile finds them there (none: count 0).
struct Ahead {
  const char* lines;
  int64_t count;
};

// Rows [m0, m0 + MR) of x (bfloat16 pairs, `pairs` a row) times NP panels from `panel` (each
// `stride` elements after the last) into the destination from panel p0 on (rows from the
// tile's first), asking for `ahead`'s lines spread over the pairs.
template <int MR, int NP, bool Gated>
SHOAL_BF16_TARGET void panel_rows(const uint32_t* x, int64_t pairs, const uint16_t* panel,
                                  int64_t stride, const Dest& dest, int64_t p0, Ahead ahead) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(panel);
  const int64_t step = 2 * stride;  // bytes from a panel to the next
  int64_t owed = 0;  // ahead's lines asked for: count every pair, one each `pairs` of it
  for (int64_t i = 0; i < pairs; ++i) {
    for (owed += ahead.count; owed >= pairs; owed -= pairs, ahead.lines += 64) {
      __builtin_prefetch(ahead.lines, 0, 2);
    }
    __m512bh w[NP];
    for (int q = 0; q < NP; ++q) {
      __builtin_prefetch(bytes + q * step + 64 * i + kAhead, 0, 0);
      w[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bytes + q * step + 64 * i));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(
          static_cast<int>(x[r * pairs + i])));
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], w[q], xv);
    }
  }
  alignas(64) float y[kWidth];
  for (int q = 0; q < NP; ++q) {
    if constexpr (Gated) {  // two panels' act channels at a time
      if (q % 2 == 0) {
        const int64_t panels = std::min(2, NP - q);
        for (int r = 0; r < MR; ++r) {
          const __m512 next = q + 1 < NP ? acc[r][q + 1] : _mm512_setzero_ps();
          store_gated(acc[r][q], next, panels, dest.gated_out + r * dest.stride, p0 + q,
                      dest.n);
        }
      }
      continue;
    }
    const int64_t c0 = (p0 + q) * kWidth, valid = std::min(kWidth, dest.n - c0);
    const float* bias = dest.bias;
    for (int r = 0; r < MR; ++r) {
      __m512 v = acc[r][q];
      if (bias != nullptr && valid == kWidth) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
      float* row = dest.out + r * dest.stride + c0;
      if (valid == kWidth) {
        _mm512_storeu_ps(row, v);
      } else {
        _mm512_store_ps(y, v);
        for (int64_t j = 0; j < valid; ++j) row[j] = y[j] + (bias != nullptr ? bias[c0 + j] : 0.f);
      }
    }
  }
}

template <int MR, int NP, bool Gated>
void bf16_rows_at(int64_t rows, const uint32_t* x, int64_t pairs, const uint16_t* panel,
                  int64_t stride, const Dest& dest, int64_t p0, Ahead ahead) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      return bf16_rows_at<MR - 1, NP, Gated>(rows, x, pairs, panel, stride, dest, p0, ahead);
    }
  }
  panel_rows<MR, NP, Gated>(x, pairs, panel, stride, dest, p0, ahead);
}

// bf16_rows_at over the `panels` (<= NP) panels left of a group: a tile of that many
template <int NP, bool Gated>
void panels_at(int64_t panels, int64_t rows, const uint32_t* x, int64_t pairs,
               const uint16_t* panel, int64_t stride, const Dest& dest, int64_t p0,
               Ahead ahead) {
  if constexpr (NP > 1) {
    if (panels < NP) {
      return panels_at<NP - 1, Gated>(panels, rows, x, pairs, panel, stride, dest, p0, ahead);
    }
  }
  bf16_rows_at<kTileRows, NP, Gated>(rows, x, pairs, panel, stride, dest, p0, ahead);
}

// x [m, K] (bfloat16 pairs) times the panels into the destination: the rows in as few tiles of
// at most kTileRows as there can be, of even sizes; threads split the panels' groups.
template <bool Gated>
void run_panels(const uint32_t* rows, int64_t m, int64_t pairs, const uint16_t* weights,
                int64_t num_panels, const Dest& dest) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t tile_rows = (m + tiles - 1) / tiles;
  const int64_t stride = pairs * 2 * kWidth;
  constexpr int64_t group = Gated ? kTileGatedPanels : kTilePanels;
  const int64_t groups = (num_panels + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * group, count = std::min(group, num_panels - p);
      // the thread's next group, asked for into L2 over this one's tiles after the first
      const int64_t next_lines = g + 1 < end ? std::min(group, num_panels - p - count) * pairs : 0;
      const char* next =
          next_lines > 0 ? reinterpret_cast<const char*>(weights + (p + count) * stride) : nullptr;
      const int64_t per_tile = tiles > 1 ? (next_lines + tiles - 2) / (tiles - 1) : 0;
      for (int64_t m0 = 0, t = 0; m0 < m; m0 += tile_rows, ++t) {
        Ahead ahead{nullptr, 0};
        if (t > 0 && (t - 1) * per_tile < next_lines) {
          const int64_t first = (t - 1) * per_tile;
          ahead = Ahead{next + 64 * first, std::min(per_tile, next_lines - first)};
        }
        Dest at_rows = dest;
        if constexpr (Gated) {
          at_rows.gated_out += m0 * dest.stride;
        } else {
          at_rows.out += m0 * dest.stride;
        }
        panels_at<group, Gated>(count, std::min(tile_rows, m - m0), rows + m0 * pairs, pairs,
                                weights + p * stride, stride, at_rows, p, ahead);
      }
    }
  });
}

#endif  // SHOAL_BF16_DOTS

// x's rows as bfloat16, contiguous: x's own memory when it is bfloat16 and contiguous, else
// a copy rounded as torch's .to(torch.bfloat16) rounds.
const uint16_t* bf16_rows(const at::Tensor& x, std::vector<uint16_t>& copy) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kBFloat16 && x.stride(0) == k) {
    return reinterpret_cast<const uint16_t*>(x.data_ptr());
  }
  if (copy.size() < static_cast<size_t>(m * k)) copy.resize(static_cast<size_t>(m * k));
  if (x.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t r = 0; r < m; ++r) std::memcpy(&copy[r * k], src + r * x.stride(0), 2 * k);
    return copy.data();
  }
  const float* src = x.data_ptr<float>();
  auto* dst = reinterpret_cast<at::BFloat16*>(copy.data());
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {  // ATen's vectorized rounding
    for (int64_t r = begin; r < end; ++r) at::vec::convert(src + r * x.stride(0), dst + r * k, k);
  });
  return copy.data();
}

}  // namespace

namespace shoal_ops {

bool bf16_panels_supported() {
#ifdef SHOAL_BF16_DOTS
  static const bool supported = cpu_has_bf16_dots();
  return supported;
#else
  return false;
#endif
}

namespace {

// Both ops' checks: x [M, K] float32 or bfloat16, rows contiguous, K even; out [M, N] of
// `dtype` (`form` names it), rows contiguous; the panels [ceil(N / width), K / 2, 32] bfloat16
// (`width` out channels a panel).
void check_panel_args(const char* op, const at::Tensor& x, const at::Tensor& panels,
                      const at::Tensor& out, at::ScalarType dtype, int64_t width,
                      const char* form) {
  TORCH_CHECK(bf16_panels_supported(), op, ": this CPU has no AVX512-BF16 dot products");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a 2-d float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": K must be even, got ", x.size(1));
  TORCH_CHECK(out.dim() == 2, op, ": out must be 2-d");
  const int64_t num_panels = (out.size(1) + width - 1) / width;
  shoal_tiles::check_tensor(op, "panels", panels, at::kBFloat16,
                            {num_panels, x.size(1) / 2, 2 * kWidth});
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == dtype && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              op, ": out must be ", form, " with contiguous rows");
}

#ifdef SHOAL_BF16_DOTS
// x times the panels into `dest`, x in bfloat16: up to kKeptCopy bytes in the calling thread's
// buffer, kept between calls (a prompt's rows are hundreds of KB, which malloc would map, fault
// in and unmap at every call), a bigger one for this call alone
template <bool Gated>
void multiply(const at::Tensor& x, const at::Tensor& panels, const Dest& dest) {
  const int64_t m = x.size(0), k = x.size(1);
  thread_local std::vector<uint16_t> kept;
  std::vector<uint16_t> once;
  auto& copy = m * k * 2 <= kKeptCopy ? kept : once;
  const auto* rows = reinterpret_cast<const uint32_t*>(bf16_rows(x, copy));
  run_panels<Gated>(rows, m, k / 2, reinterpret_cast<const uint16_t*>(panels.data_ptr()),
                    panels.size(0), dest);
}
#endif

}  // namespace

void bf16_panel_linear(const at::Tensor& x, const at::Tensor& panels,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const char* op = "bf16_panel_linear";
  check_panel_args(op, x, panels, out, at::kFloat, kWidth, "a float32 [M, N]");
  const int64_t m = x.size(0), n = out.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
  }
  if (m == 0 || n == 0) return;
#ifdef SHOAL_BF16_DOTS
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  multiply<false>(x, panels, Dest{bias_data, out.data_ptr<float>(), nullptr, out.stride(0), n});
#endif
}

void bf16_silu_mul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& out) {
  const char* op = "bf16_silu_mul";
  check_panel_args(op, x, panels, out, at::kBFloat16, kGatedWidth, "a bfloat16 [M, I]");
  const int64_t m = x.size(0), inter = out.size(1);
  if (m == 0 || inter == 0) return;
#ifdef SHOAL_BF16_DOTS
  auto* act = reinterpret_cast<uint16_t*>(out.data_ptr());
  multiply<true>(x, panels, Dest{nullptr, nullptr, act, out.stride(0), inter});
#endif
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("bf16_panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::bf16_panel_linear);
  m.def("bf16_silu_mul(Tensor x, Tensor panels, Tensor(a!) out) -> ()",
        &shoal_ops::bf16_silu_mul);
  m.def("bf16_panels_supported() -> bool", &shoal_ops::bf16_panels_supported);
}
