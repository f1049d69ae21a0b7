// bench/w8a8_probe.py's kernels: what int8's many-row steps could do with 8-bit activations on
// a CPU with AVX512-VNNI and no AMX. Not one of shoal's kernels (kernels/csrc): a probe,
// measured beside them.
//
//   shoal_probe::u8_linear(x, panels, bias, out)   x [M, K] float32 (or bfloat16), rows
//                   contiguous, K = 32 B; panels uint8 [P, B, 704], P = ceil(N / 16); bias [N]
//                   float32 or None; out [M, N] float32, rows contiguous
//   shoal_probe::tile_seconds(reps) -> [u8 s, bf16 s, sink]   one register tile of each in L1
//
// A panel's block b (704 bytes) holds 16 output channels' 32 weights of K's block b as 8
// quads, then three float32 vectors of 16:
//   bytes 64 i + 4 j + t   channel j's weight q (int8) at K = 32 b + 4 i + t
//   dw  at 512             the block's scale          w = dw * q + mw
//   cw  at 576             dw * (sum of the block's q), for the activations' minimum
//   mw  at 640             the block's minimum (GGUF Q4_1's m; 0 for int8 blocks)
// (w8a8_probe.py packs them from quant.py's Q4 and Q8 blocks, which hold the bundled
// GGUF's weights to the bit.)
//
// Each row's block of 32 is rounded to unsigned 8 bits from its minimum: a = dx * u + mx, u in
// 0..255, dx = (max - min) / 255 (the row's block of a SiLU's outputs, which lie mostly above
// 0, gets about twice the steps of a symmetric rounding). Then for each block
//   sum_k a w = dx dw (u . q) + mx cw + mw (dx sum u + 32 mx)
// where u . q is one `vpdpbusd` per 4 of K, exact in int32 (255 * 127 * 32 fits), the rest in
// float32. The rounding costs SmolLM2 1.8 points of top-1 agreement with float32 (98.23%, the
// whole text at chunks of 512; bench/act8_emulation.py --act-asym), inside int8's 97%.
//
// A tile is 4 rows x 2 panels (8 int32 and 8 float32 sums); threads split the panels' pairs,
// each thread sweeps the rows 4 at a time over a pair's blocks (in L1 after the first tile).
// Rows are rounded once before (threads split them), into a buffer kept between calls.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tiles.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define SHOAL_U8_DOTS 1
#endif

namespace {

constexpr int64_t kWidth = 16;       // output channels a panel
constexpr int64_t kBlock = 32;       // K a block
constexpr int64_t kBlockBytes = 704;  // 512 of quads, then dw, cw, mw
constexpr int kTileRows = 4;
constexpr int kTilePanels = 2;

#ifdef SHOAL_U8_DOTS

#define SHOAL_U8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define SHOAL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_vnni() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & (1u << 11)) != 0 && (ebx & (1u << 16)) != 0;  // AVX512_VNNI, AVX512F
}

// A row's blocks rounded: u [K] uint8, and per block dx, mx and sa = dx * sum u + 32 mx (the
// rounded block's sum).
struct Rounded {
  std::vector<uint8_t> u;
  std::vector<float> dx, mx, sa;
};

// One block of 32 float32 values rounded into u; gives its (dx, mx, sa).
SHOAL_U8_TARGET void round_block(const float* v, uint8_t* u, float* dx, float* mx, float* sa) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float lo = _mm512_reduce_min_ps(_mm512_min_ps(a, b));
  const float hi = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  const float step = hi > lo ? (hi - lo) / 255.f : 1.f;
  const __m512 low = _mm512_set1_ps(lo), steps = _mm512_set1_ps(step);
  const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
  // (v - lo) / step, rounded to nearest even (the default rounding mode), as torch.round
  __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_sub_ps(a, low), steps));
  __m512i qb = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_sub_ps(b, low), steps));
  qa = _mm512_min_epi32(_mm512_max_epi32(qa, zero), top);
  qb = _mm512_min_epi32(_mm512_max_epi32(qb, zero), top);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm512_cvtepi32_epi8(qb));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  *dx = step;
  *mx = lo;
  *sa = step * static_cast<float>(sum) + kBlock * lo;
}

void round_rows(const at::Tensor& x, int64_t blocks, Rounded& r) {
  const int64_t m = x.size(0), k = x.size(1);
  r.u.resize(m * k);
  r.dx.resize(m * blocks);
  r.mx.resize(m * blocks);
  r.sa.resize(m * blocks);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::BFloat16* halves = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  const float* floats = bf16 ? nullptr : x.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float v[kBlock];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = row * x.stride(0) + b * kBlock;
        const float* block = v;
        if (bf16) {
          for (int64_t i = 0; i < kBlock; ++i) v[i] = static_cast<float>(halves[at + i]);
        } else {
          block = floats + at;
        }
        const int64_t s = row * blocks + b;
        round_block(block, r.u.data() + row * k + b * kBlock, &r.dx[s], &r.mx[s], &r.sa[s]);
      }
    }
  });
}

// Where a tile's sums go: out [M, n] (rows `stride` apart) plus the bias, if any.
struct Dest {
  float* out;
  int64_t stride, n;
  const float* bias;
};

// rows m0 .. m0 + R - 1 times panels p0 .. p0 + Q - 1 into d (a panel's channels past n not
// written)
template <int R, int Q>
SHOAL_U8_TARGET void tile(const uint8_t* panels, int64_t panel_bytes, int64_t blocks,
                          const Rounded& r, int64_t k, int64_t m0, int64_t p0, const Dest& d) {
  __m512 acc[R][Q];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < Q; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][Q];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512i w[Q];
      for (int q = 0; q < Q; ++q) {
        w[q] = _mm512_loadu_si512(panels + q * panel_bytes + b * kBlockBytes + 64 * i);
      }
      for (int row = 0; row < R; ++row) {
        int32_t four;
        std::memcpy(&four, r.u.data() + (m0 + row) * k + b * kBlock + 4 * i, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int q = 0; q < Q; ++q) {
          dot[row][q] = _mm512_dpbusd_epi32(i ? dot[row][q] : _mm512_setzero_si512(), a, w[q]);
        }
      }
    }
    for (int q = 0; q < Q; ++q) {
      const uint8_t* block = panels + q * panel_bytes + b * kBlockBytes;
      const auto* s = reinterpret_cast<const float*>(block + 512);
      const __m512 dw = _mm512_loadu_ps(s), cw = _mm512_loadu_ps(s + 16);
      const __m512 mw = _mm512_loadu_ps(s + 32);
      for (int row = 0; row < R; ++row) {
        const int64_t at = (m0 + row) * blocks + b;
        const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[row][q]), dw);
        acc[row][q] = _mm512_fmadd_ps(p, _mm512_set1_ps(r.dx[at]), acc[row][q]);
        acc[row][q] = _mm512_fmadd_ps(cw, _mm512_set1_ps(r.mx[at]), acc[row][q]);
        acc[row][q] = _mm512_fmadd_ps(mw, _mm512_set1_ps(r.sa[at]), acc[row][q]);
      }
    }
  }
  for (int q = 0; q < Q; ++q) {
    const int64_t c0 = (p0 + q) * kWidth, valid = std::min(kWidth, d.n - c0);
    const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bias =
        d.bias != nullptr ? _mm512_maskz_loadu_ps(lanes, d.bias + c0) : _mm512_setzero_ps();
    for (int row = 0; row < R; ++row) {
      _mm512_mask_storeu_ps(d.out + (m0 + row) * d.stride + c0, lanes,
                            _mm512_add_ps(acc[row][q], bias));
    }
  }
}

template <int R, int Q>
SHOAL_U8_TARGET void tile_rows(int64_t rows, const uint8_t* panels, int64_t panel_bytes,
                               int64_t blocks, const Rounded& r, int64_t k, int64_t m0,
                               int64_t p0, const Dest& d) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1, Q>(rows, panels, panel_bytes, blocks, r, k, m0, p0, d);
  }
  tile<R, Q>(panels, panel_bytes, blocks, r, k, m0, p0, d);
}

// The sketch's tile (bench/README.md): a block's scales, no weights' minimum. Rows 0..3 of x (uint8 [4, K]) times panels 0..1 (int8 [2][B][512]: quad i of block b holds
// 16 channels x 4 of K at 64 i), each block's sums scaled by dw[p][b] * dx[r][b] and the
// block's minimum mx[r][b] times cw[p][b] added: out [4][32] float
SHOAL_U8_TARGET void u8_tile(const int8_t* w, int64_t w_stride, const float* dw, const float* cw,
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
SHOAL_BF16_TARGET void bf16_tile(const uint16_t* w, int64_t w_stride, const uint16_t* x, int64_t K,
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

#endif  // SHOAL_U8_DOTS

}  // namespace

namespace shoal_probe {

bool u8_panels_supported() {
#ifdef SHOAL_U8_DOTS
  static const bool supported = cpu_has_vnni();
  return supported;
#else
  return false;
#endif
}

// seconds for `reps` passes of each tile over K = 576 with its operands in L1 (one thread)
std::vector<double> tile_seconds(int64_t reps) {
  TORCH_CHECK(u8_panels_supported(), "tile_seconds: this CPU has no AVX512-VNNI");
#ifdef SHOAL_U8_DOTS
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
#else
  return {};
#endif
}

void u8_linear(const at::Tensor& x, const at::Tensor& panels,
               const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const char* op = "u8_linear";
  TORCH_CHECK(u8_panels_supported(), op, ": this CPU has no AVX512-VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a 2-d float32 or bfloat16 CPU tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && k > 0, op, ": K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(out.dim() == 2 && out.device().is_cpu() && out.scalar_type() == at::kFloat &&
                  out.stride(1) == 1 && out.size(0) == m,
              op, ": out must be a float32 [M, N] with contiguous rows");
  const int64_t n = out.size(1), blocks = k / kBlock;
  const int64_t num_panels = (n + kWidth - 1) / kWidth;
  shoal_tiles::check_tensor(op, "panels", panels, at::kByte, {num_panels, blocks, kBlockBytes});
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
  }
  if (m == 0 || n == 0) return;
#ifdef SHOAL_U8_DOTS
  thread_local Rounded kept;  // kept between calls: a prompt's rows are hundreds of KB
  Rounded& rounded = kept;     // the caller's, which the workers below read
  round_rows(x, blocks, rounded);
  const auto* weights = panels.data_ptr<uint8_t>();
  const int64_t panel_bytes = blocks * kBlockBytes;
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  const int64_t stride = out.stride(0);
  const int64_t pairs = (num_panels + kTilePanels - 1) / kTilePanels;
  const Dest dest{dst, stride, n, bias_data};
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kTilePanels;
      const uint8_t* at_panels = weights + p0 * panel_bytes;
      for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, m - m0);
        if (num_panels - p0 >= kTilePanels) {
          tile_rows<kTileRows, kTilePanels>(rows, at_panels, panel_bytes, blocks, rounded, k, m0,
                                            p0, dest);
        } else {  // the last panels, one at a time
          for (int64_t p = p0; p < num_panels; ++p) {
            tile_rows<kTileRows, 1>(rows, weights + p * panel_bytes, panel_bytes, blocks, rounded,
                                    k, m0, p, dest);
          }
        }
      }
    }
  });
#endif
}

}  // namespace shoal_probe

TORCH_LIBRARY(shoal_probe, m) {
  m.def("u8_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_probe::u8_linear);
  m.def("u8_panels_supported() -> bool", &shoal_probe::u8_panels_supported);
  m.def("tile_seconds(int reps) -> float[]", &shoal_probe::tile_seconds);
}
