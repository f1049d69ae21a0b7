// A float32 matrix product over weights packed in panels (linear.cpp's f32_linear):
//
//   panels   [P, K, 16] float32, P = ceil(N / 16): panel p holds output channels 16p .. 16p + 15,
//            each k's 16 weights side by side (channels past N are zeros)
//   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
//
// The tile (AVX2): up to 6 rows of x times one panel's 16 channels, in 12 vector accumulators
// that stay in registers over all of K; each k loads the panel's 16 weights once (two vectors)
// and broadcasts each row's x[m, k]: 12 fused multiply-adds for 8 loads, so the tile runs at
// the multiply-add units' rate. AVX-512: up to 12 rows times two panels, 24 accumulators, each
// row's x[m, k] broadcast once for both: on a Zen 5 EPYC (two 512-bit multiply-adds a cycle)
// one panel's 12 sums left the units idle (SmolLM2's layers from cache, bench/linear_kinds.py:
// 1 row 3.44 ms -> 2.62, 16 rows 9.23 -> 7.92, 64 rows 31.66 -> 27.2 against oneDNN's 29.8,
// 256 rows 139.2 -> 107.7 against 109.6; three panels of 8 rows were slower: 256 rows 133.8).
// Threads split the panels; a thread runs every row tile over its panels while they sit in its
// L2. From kBlockFrom rows a thread takes the rows in blocks that fit its
// L2 beside a panel, each block over all its panels: at 1,800 rows (a whole-prompt prefill) x
// no longer streams from L3 once a panel (4 MB, 192 times for gate_up), 177 -> 185 GFLOP/s
// over SmolLM2's layers. Each output is one chain of multiply-adds in k order, added to the
// bias last, whatever the blocks.
//
// The next panel is asked for from memory while this one is multiplied, a share of its lines
// in each row tile after the first. Without it the first tile over each panel waited for the
// panel's lines (37 KB at K = 576, which the hardware prefetcher fetches no faster than memory
// gives them), the rest found them in L2: over SmolLM2's layers, weights from memory, 16 rows
// went from 114-130 GFLOP/s to 130-147, 41 rows from 151-165 to 175-183, 64 from 162-171 to
// 181-188.
//
// On the 2-core AVX2 EPYC it beat oneDNN's packed float32 matmul at every row count measured,
// all of SmolLM2's linears in a row (bench/README.md): 1 row 19.6 ms against 25.0, 16 rows
// 37.2 against 53.5, 64 rows 111 against 142, 512 rows 848 against 961. On a Zen 3 EPYC
// (AVX2 alone) it is level with oneDNN to 64 rows and 1.1-1.3x behind at 256 (bench/README.md,
// "Zen 3 EPYC"); neither a pointer a row in the tile nor smaller row blocks moved that.
//
// The accumulators are named variables, not an array: GCC kept an array of them on the stack
// and stored each one back every k, which halved the rate.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "silu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SHOAL_PANELS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_PANELS_AVX2 1
#endif

namespace shoal_panels {

constexpr int64_t kWidth = 16;  // output channels a panel
constexpr int64_t kGatedWidth = kWidth / 2;  // gated panels: 8 gate channels, then their 8 ups
#ifdef SHOAL_PANELS_AVX512
constexpr int64_t kMaxRows = 12;     // a zmm accumulator a row and panel
constexpr int64_t kPanelsATile = 2;  // 24 accumulators
#else
constexpr int64_t kMaxRows = 6;  // two ymm accumulators a row
constexpr int64_t kPanelsATile = 1;
#endif
constexpr int64_t kBlockFrom = 384;        // rows from which a thread takes them in blocks
constexpr int64_t kBlockBytes = 128 << 10;  // of x, a block (L2 is 512 KiB a core here)

// Lines of panels to ask for from memory while a tile multiplies: `count` of them (one k,
// 16 floats, 64 bytes, each) from `line`.
struct Ahead {
  const float* line;
  int64_t count;
};

// Spreads an Ahead's lines over a tile's k loop, at tick(), which the loop calls once a k:
// `per` lines every `every` k (more lines than k, as a tile of two panels asks for the next
// two: two a k).
struct AheadPace {
  Ahead ahead;
  int64_t per, every, countdown;
  AheadPace(Ahead a, int64_t k_len)
      : ahead(a),
        per(std::max<int64_t>(1, (a.count + k_len - 1) / k_len)),
        every(a.count > 0 ? std::max<int64_t>(1, k_len * per / a.count) : 0),
        countdown(every) {}
  void tick() {
    if (--countdown == 0 && ahead.count > 0) {
      for (int64_t i = 0; i < per && ahead.count > 0; ++i) {
        __builtin_prefetch(ahead.line, 0, 3);
        ahead.line += kWidth;
        --ahead.count;
      }
      countdown = every;
    }
  }
};

struct Product {
  const float* x;
  int64_t x_stride;
  int64_t rows;
  const float* panels;
  int64_t k_len;
  int64_t n;
  const float* bias;  // or nullptr
  float* out;
  int64_t out_stride;
  bool gated = false;  // panels of 8 gate and 8 up channels; out = silu(gate) * up, n of them

  // out[m0 .. m0 + MR, the channels of panels p .. p + NP - 1]; meanwhile `ahead.count` lines
  // from `ahead.line` are asked for, spread over the k loop (AheadPace).
  template <int MR, int NP>
  void tile(int64_t m0, int64_t p, Ahead ahead) const {
    const float* xs = x + m0 * x_stride;
    const float* w = panels + p * k_len * kWidth;
    float sums[kPanelsATile][kMaxRows][kWidth];
#if defined(SHOAL_PANELS_AVX512)
    // panel p's sums a0 .., panel p + 1's b0 .. (named: see the top)
    const float* w_next = w + k_len * kWidth;
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z;
    __m512 a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z;
    __m512 b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z;
    __m512 b6 = z, b7 = z, b8 = z, b9 = z, b10 = z, b11 = z;
    AheadPace pace(ahead, k_len);
    for (int64_t k = 0; k < k_len; ++k) {
      pace.tick();
      const __m512 w0 = _mm512_loadu_ps(w + k * kWidth);
      __m512 w1 = z;
      if constexpr (NP > 1) w1 = _mm512_loadu_ps(w_next + k * kWidth);
#define SHOAL_PANEL_ROW(r)                                                  \
  if constexpr (MR > r) {                                                   \
    const __m512 xr = _mm512_set1_ps(xs[r * x_stride + k]);                 \
    a##r = _mm512_fmadd_ps(xr, w0, a##r);                                   \
    if constexpr (NP > 1) b##r = _mm512_fmadd_ps(xr, w1, b##r);             \
  }
      SHOAL_PANEL_ROW(0)
      SHOAL_PANEL_ROW(1)
      SHOAL_PANEL_ROW(2)
      SHOAL_PANEL_ROW(3)
      SHOAL_PANEL_ROW(4)
      SHOAL_PANEL_ROW(5)
      SHOAL_PANEL_ROW(6)
      SHOAL_PANEL_ROW(7)
      SHOAL_PANEL_ROW(8)
      SHOAL_PANEL_ROW(9)
      SHOAL_PANEL_ROW(10)
      SHOAL_PANEL_ROW(11)
#undef SHOAL_PANEL_ROW
    }
    const __m512 acc[kPanelsATile][kMaxRows] = {
        {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11},
        {b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11}};
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < MR; ++r) _mm512_storeu_ps(sums[q][r], acc[q][r]);
#elif defined(SHOAL_PANELS_AVX2)
    static_assert(NP == 1, "AVX2 tiles are one panel");
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z;
    __m256 a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
    AheadPace pace(ahead, k_len);
    for (int64_t k = 0; k < k_len; ++k) {
      pace.tick();
      const __m256 w0 = _mm256_loadu_ps(w + k * kWidth);
      const __m256 w1 = _mm256_loadu_ps(w + k * kWidth + 8);
#define SHOAL_PANEL_ROW(r)                                       \
  if constexpr (MR > r) {                                        \
    const __m256 xr = _mm256_broadcast_ss(xs + r * x_stride + k); \
    a##r##0 = _mm256_fmadd_ps(xr, w0, a##r##0);                  \
    a##r##1 = _mm256_fmadd_ps(xr, w1, a##r##1);                  \
  }
      SHOAL_PANEL_ROW(0)
      SHOAL_PANEL_ROW(1)
      SHOAL_PANEL_ROW(2)
      SHOAL_PANEL_ROW(3)
      SHOAL_PANEL_ROW(4)
      SHOAL_PANEL_ROW(5)
#undef SHOAL_PANEL_ROW
    }
    const __m256 acc[kMaxRows][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                     {a30, a31}, {a40, a41}, {a50, a51}};
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(sums[0][r], acc[r][0]);
      _mm256_storeu_ps(sums[0][r] + 8, acc[r][1]);
    }
#else
    static_assert(NP == 1, "scalar tiles are one panel");
    for (int r = 0; r < MR; ++r) {
      for (int64_t c = 0; c < kWidth; ++c) sums[0][r][c] = 0.f;
      for (int64_t k = 0; k < k_len; ++k) {
        for (int64_t c = 0; c < kWidth; ++c) {
          sums[0][r][c] = std::fma(xs[r * x_stride + k], w[k * kWidth + c], sums[0][r][c]);
        }
      }
    }
#endif
    for (int q = 0; q < NP; ++q) store(sums[q], MR, m0, p + q);
  }

  // A tile's sums of panel p (MR rows) into out: as they are, plus the bias, or gated.
  void store(const float (*sums)[kWidth], int mr, int64_t m0, int64_t p) const {
    if (gated) {
      for (int r = 0; r < mr; ++r) silu_mul(sums[r], out + (m0 + r) * out_stride, p);
      return;
    }
    const int64_t c0 = p * kWidth, cols = std::min(kWidth, n - c0);
    for (int r = 0; r < mr; ++r) {
      float* dst = out + (m0 + r) * out_stride + c0;
      for (int64_t c = 0; c < cols; ++c) {
        dst[c] = bias != nullptr ? sums[r][c] + bias[c0 + c] : sums[r][c];
      }
    }
  }

  // dst[8p ..] = silu(gate) * up of one row's gated panel p (sums: its 8 gates, its 8 ups),
  // each channel as elementwise.cpp's silu_mul computes it (silu.h): in vector lanes below the
  // last whole vector of its row, one by one past it; so the bits are silu_mul's.
  void silu_mul(const float* sums, float* dst, int64_t p) const {
    using shoal_silu::Vec;
    const int64_t c0 = p * kGatedWidth, cols = std::min(kGatedWidth, n - c0);
    const int64_t vector_end = n / Vec::size() * Vec::size();
    if (c0 + kGatedWidth <= vector_end) {
      const Vec gate = Vec::loadu(sums, kGatedWidth);
      const Vec up = Vec::loadu(sums + kGatedWidth, kGatedWidth);
      shoal_silu::silu_mul(gate, up).store(dst + c0, kGatedWidth);
      return;
    }
    for (int64_t c = 0; c < cols; ++c) {
      dst[c0 + c] = shoal_silu::silu_mul(sums[c], sums[kGatedWidth + c]);
    }
  }

  // The row tiles of rows [m_begin, m_end) over panels p .. p + NP - 1. `next` (or nullptr):
  // the panels that follow (`next_lines` lines of them, one a k), asked for from memory over
  // the tiles after the first; the first waits on these panels' own lines.
  template <int NP>
  void panel_rows(int64_t m_begin, int64_t m_end, int64_t p, const float* next,
                  int64_t next_lines) const {
    const int64_t tiles = (m_end - m_begin + kMaxRows - 1) / kMaxRows;
    const int64_t size = (m_end - m_begin + tiles - 1) / tiles;  // even tiles: 16 rows, 8 + 8
    const int64_t per_tile =
        next != nullptr && tiles > 1 ? (next_lines + tiles - 2) / (tiles - 1) : 0;
    int64_t m0 = m_begin;
    for (int64_t t = 0; m0 < m_end; ++t, m0 += size) {
      Ahead ahead{nullptr, 0};
      if (per_tile > 0 && t > 0 && (t - 1) * per_tile < next_lines) {
        const int64_t first = (t - 1) * per_tile;
        ahead = Ahead{next + first * kWidth, std::min(per_tile, next_lines - first)};
      }
      switch (std::min(size, m_end - m0)) {
#ifdef SHOAL_PANELS_AVX512
        case 12: tile<12, NP>(m0, p, ahead); break;
        case 11: tile<11, NP>(m0, p, ahead); break;
        case 10: tile<10, NP>(m0, p, ahead); break;
        case 9: tile<9, NP>(m0, p, ahead); break;
        case 8: tile<8, NP>(m0, p, ahead); break;
        case 7: tile<7, NP>(m0, p, ahead); break;
#endif
        case 6: tile<6, NP>(m0, p, ahead); break;
        case 5: tile<5, NP>(m0, p, ahead); break;
        case 4: tile<4, NP>(m0, p, ahead); break;
        case 3: tile<3, NP>(m0, p, ahead); break;
        case 2: tile<2, NP>(m0, p, ahead); break;
        default: tile<1, NP>(m0, p, ahead); break;
      }
    }
  }

  void run() const {
    const int64_t width = gated ? kGatedWidth : kWidth;
    const int64_t num_panels = (n + width - 1) / width;
    const int64_t block = row_block();
    const int64_t panel_size = k_len * kWidth;
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m_begin = 0; m_begin < rows; m_begin += block) {
        const int64_t m_end = std::min(rows, m_begin + block);
        for (int64_t p = begin; p < end; p += kPanelsATile) {
          const int64_t count = std::min(kPanelsATile, end - p);
          const int64_t after = std::min(kPanelsATile, end - p - count);  // panels next
          const float* next = after > 0 ? panels + (p + count) * panel_size : nullptr;
          if (count > 1) {
            panel_rows<kPanelsATile>(m_begin, m_end, p, next, after * k_len);
          } else {
            panel_rows<1>(m_begin, m_end, p, next, after * k_len);
          }
        }
      }
    });
  }

  // Rows a thread takes over all its panels before the next rows: all of them up to
  // kBlockFrom, else as many as fill kBlockBytes of x, so that they stay in its L2 while the
  // panels stream past.
  int64_t row_block() const {
    if (rows < kBlockFrom) return rows;
    const int64_t fit = kBlockBytes / (k_len * static_cast<int64_t>(sizeof(float)));
    return std::max(kMaxRows, fit / kMaxRows * kMaxRows);
  }
};

}  // namespace shoal_panels
