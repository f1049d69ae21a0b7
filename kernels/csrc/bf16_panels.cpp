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
#include "tiles.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define SHOAL_BF16_DOTS 1
#endif

namespace {

constexpr int64_t kWidth = 16;     // output channels a panel
constexpr int64_t kPanels = 3;     // panels a tile
constexpr int kMaxRows = 8;        // rows a tile: 8 x 3 accumulators
constexpr int64_t kAhead = 1024;   // bytes of a panel asked for ahead
constexpr int64_t kKeptCopy = int64_t{8} << 20;  // bytes of x in bfloat16 a thread keeps

#ifdef SHOAL_BF16_DOTS

#define SHOAL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16_dots() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax & (1u << 5)) != 0;  // AVX512_BF16
}

// Rows [m0, m0 + MR) of x (bfloat16 pairs, `pairs` a row) times NP panels from `panel` (each
// `stride` elements after the last) into out's channels from n0 (n: the output's channels).
template <int MR, int NP>
SHOAL_BF16_TARGET void panel_rows(const uint32_t* x, int64_t pairs, const uint16_t* panel,
                                  int64_t stride, const float* bias, float* out,
                                  int64_t out_stride, int64_t n0, int64_t n) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(panel);
  const int64_t step = 2 * stride;  // bytes from a panel to the next
  for (int64_t i = 0; i < pairs; ++i) {
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
    const int64_t c0 = n0 + q * kWidth, valid = std::min(kWidth, n - c0);
    for (int r = 0; r < MR; ++r) {
      __m512 v = acc[r][q];
      if (bias != nullptr && valid == kWidth) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
      float* row = out + r * out_stride + c0;
      if (valid == kWidth) {
        _mm512_storeu_ps(row, v);
      } else {
        _mm512_store_ps(y, v);
        for (int64_t j = 0; j < valid; ++j) row[j] = y[j] + (bias != nullptr ? bias[c0 + j] : 0.f);
      }
    }
  }
}

template <int MR, int NP>
void rows_at(int64_t rows, const uint32_t* x, int64_t pairs, const uint16_t* panel,
             int64_t stride, const float* bias, float* out, int64_t out_stride, int64_t n0,
             int64_t n) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      return rows_at<MR - 1, NP>(rows, x, pairs, panel, stride, bias, out, out_stride, n0, n);
    }
  }
  panel_rows<MR, NP>(x, pairs, panel, stride, bias, out, out_stride, n0, n);
}

// rows_at over the `panels` (<= NP) panels left of a group: a tile of that many
template <int NP>
void panels_at(int64_t panels, int64_t rows, const uint32_t* x, int64_t pairs,
               const uint16_t* panel, int64_t stride, const float* bias, float* out,
               int64_t out_stride, int64_t n0, int64_t n) {
  if constexpr (NP > 1) {
    if (panels < NP) {
      return panels_at<NP - 1>(panels, rows, x, pairs, panel, stride, bias, out, out_stride, n0, n);
    }
  }
  rows_at<kMaxRows, NP>(rows, x, pairs, panel, stride, bias, out, out_stride, n0, n);
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

void bf16_panel_linear(const at::Tensor& x, const at::Tensor& panels,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const char* op = "bf16_panel_linear";
  TORCH_CHECK(bf16_panels_supported(), op, ": this CPU has no AVX512-BF16 dot products");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a 2-d float32 or bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(out.dim() == 2, op, ": out must be 2-d");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(k % 2 == 0, op, ": K must be even, got ", k);
  const int64_t num_panels = (n + kWidth - 1) / kWidth, pairs = k / 2;
  shoal_tiles::check_tensor(op, "panels", panels, at::kBFloat16, {num_panels, pairs, 2 * kWidth});
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == m,
              op, ": out must be a float32 [M, N] with contiguous rows");
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
  }
  if (m == 0 || n == 0) return;
#ifdef SHOAL_BF16_DOTS
  // x in bfloat16: up to kKeptCopy bytes in the calling thread's buffer, kept between calls
  // (a prompt's rows are hundreds of KB, which malloc would map, fault in and unmap at every
  // call), a bigger one for this call alone
  thread_local std::vector<uint16_t> kept;
  std::vector<uint16_t> once;
  auto& copy = m * k * 2 <= kKeptCopy ? kept : once;
  const auto* rows = reinterpret_cast<const uint32_t*>(bf16_rows(x, copy));
  const auto* weights = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const int64_t out_stride = out.stride(0);
  // the rows in as few tiles of at most kMaxRows as there can be, of even sizes
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t tile_rows = (m + tiles - 1) / tiles;
  const int64_t stride = pairs * 2 * kWidth;
  const int64_t groups = (num_panels + kPanels - 1) / kPanels;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p = g * kPanels, count = std::min(kPanels, num_panels - p);
      for (int64_t m0 = 0; m0 < m; m0 += tile_rows) {
        panels_at<kPanels>(count, std::min(tile_rows, m - m0), rows + m0 * pairs, pairs,
                           weights + p * stride, stride, bias_data, out_data + m0 * out_stride,
                           out_stride, p * kWidth, n);
      }
    }
  });
#endif
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("bf16_panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::bf16_panel_linear);
  m.def("bf16_panels_supported() -> bool", &shoal_ops::bf16_panels_supported);
}
