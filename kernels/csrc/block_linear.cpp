// Linears over weights in blocks of 32 along K, for `quantization="int8"` (quant.py), in
// panels of 16 output channels (blocks.h has the layouts):
//
//   q8_linear(x, q, d, bias, out)      q int8 [P, B, 512], d float32 [P, B, 16]:
//                                      w[16 p + j, 32 b + k] = (its int8) * d[p, b, j]
//   q4_linear(x, q, d, m, bias, out)   q uint8 [P, B, 256], GGUF Q4_1's 4-bit weights;
//                                      d, m float32 [P, B, 16]: w = q * d + m
//
//     x [M, K] float32, rows contiguous, B = ceil(K / 32) (q4: K = 32 B); weights past K are 0;
//     P = ceil(N / 16), N = out's columns (the panels' last channels past N are 0)
//     bias [N] float32 or None; out [M, N] float32, rows contiguous
//
// x is quantized per row and block of 32 to int16 (scale = the block's max |x| / 32767,
// rounded to nearest): 15 bits, an error of at most 1.5e-5 of the block's largest value, where
// 8 bits cost SmolLM2 3% of its top-1 agreement (bench/README.md). A panel's block is 16 pairs
// of K, each 16 channels x 2 weights: one vpmaddwd (with VNNI vpdpwssd, which adds it in) of a
// pair against the row's two x of that pair, broadcast, adds to the 16 channels' sums in its 16
// lanes, exactly in int32; after the block's 16 pairs the sums are scaled by both scales in
// float32, 16 channels an instruction:
//   y[m, n] = sum_b (d[n, b] * dx[m, b]) * sum_k q[n, k] * xq[m, k]   (+ m[n, b] * sum_k x[m, k])
// Q4_1's minimum multiplies the block's sum of the float x. A step's rows go through a panel up
// to 8 at a time (4 without AVX-512), so that its weights are read and unpacked once for them
// and a row costs its products and 4 instructions a block: a speculating decode's 1 + drafts
// rows cost little more than one (an earlier layout, a block's 32 weights of one channel, cost
// 3 instructions a block and channel a row). Threads split the panels; weights are prefetched
// 2 KB ahead. Each thread quantizes the rows itself: rows one core wrote and the other read
// cost more than quantizing them twice (2 threads, SmolLM2's layers with their weights in
// cache, 9 rows: 238 us a layer against 280; two panels of 256 rows: 85 us against 190-690;
// with the weights streamed from memory the same within the noise).
//
// They are for the few-row steps that read the weights more than they compute; from
// quant.MANY_ROWS rows on, `Int8Linear` multiplies the dequantized weight kept in float32
// panels instead (linear.cpp).

#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "ops.h"

#include "blocks.h"
#include "tiles.h"

namespace {

using shoal_tiles::check_tensor;

using shoal_blocks::kBlock;
using shoal_blocks::kPairs;
using shoal_blocks::kPanel;
using shoal_blocks::Q4;
using shoal_blocks::Q8;
using shoal_blocks::QuantizedRows;

constexpr int64_t kPrefetchBytes = 2048;
#ifdef SHOAL_BLOCKS_512
constexpr int kMaxRows = 8;  // 2 x 8 of the 32 zmm registers
#else
constexpr int kMaxRows = 4;  // 2 x 4 of the 16 ymm registers
#endif

template <typename W>
struct PanelTile {
  W w;
  const QuantizedRows* x;
  const float* bias;
  float* out;
  int64_t out_stride;
  int64_t n;

  // x's pair p of block b in row r, as one int32 (two int16)
  int32_t x_pair(const int16_t* xq, int r, int64_t b, int p) const {
    int32_t pair;
    std::memcpy(&pair, xq + (r * w.blocks + b) * kBlock + 2 * p, sizeof(pair));
    return pair;
  }

  // out[m0 + r, 16 panel ..] for r < MR
  template <int MR>
  void at(int64_t m0, int64_t panel) const {
    const int64_t blocks = w.blocks;
    const int16_t* xq = x->q.data() + m0 * blocks * kBlock;
    const float* dx = x->scale.data() + m0 * blocks;
    const float* sx = x->sum.data() + m0 * blocks;
    alignas(64) float y[MR][kPanel];
#if defined(SHOAL_BLOCKS_512)
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w.block(panel, b);
      for (int64_t i = 0; i < W::kBlockBytes; i += 64) __builtin_prefetch(blk + kPrefetchBytes + i, 0, 0);
      __m512i dot[MR];
      for (int r = 0; r < MR; ++r) dot[r] = _mm512_setzero_si512();
      W::pairs(blk, [&](int p, __m512i wv) {
        for (int r = 0; r < MR; ++r) {
          const __m512i xv = _mm512_set1_epi32(x_pair(xq, r, b, p));
#ifdef SHOAL_VNNI
          dot[r] = _mm512_dpwssd_epi32(dot[r], wv, xv);
#else
          dot[r] = _mm512_add_epi32(dot[r], _mm512_madd_epi16(wv, xv));
#endif
        }
      });
      const int64_t si = (panel * blocks + b) * kPanel;
      const __m512 dw = _mm512_loadu_ps(w.d + si);
      for (int r = 0; r < MR; ++r) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * blocks + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      }
      if constexpr (W::kHasMin) {
        const __m512 mw = _mm512_loadu_ps(w.m + si);
        for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) _mm512_store_ps(y[r], acc[r]);
#elif defined(SHOAL_LINEAR_AVX2)
    for (int half = 0; half < 2; ++half) {
      __m256 acc[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = w.block(panel, b);
        if (half == 0) {
          for (int64_t i = 0; i < W::kBlockBytes; i += 64) __builtin_prefetch(blk + kPrefetchBytes + i, 0, 0);
        }
        __m256i dot[MR];
        for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_si256();
        W::half_pairs(blk, half, [&](int p, __m256i wv) {
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = _mm256_set1_epi32(x_pair(xq, r, b, p));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(wv, xv));
          }
        });
        const int64_t si = (panel * blocks + b) * kPanel + 8 * half;
        const __m256 dw = _mm256_loadu_ps(w.d + si);
        for (int r = 0; r < MR; ++r) {
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * blocks + b]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
        }
        if constexpr (W::kHasMin) {
          const __m256 mw = _mm256_loadu_ps(w.m + si);
          for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * blocks + b]), acc[r]);
        }
      }
      for (int r = 0; r < MR; ++r) _mm256_store_ps(y[r] + 8 * half, acc[r]);
    }
#else
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kPanel; ++j) y[r][j] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w.block(panel, b);
      const int64_t si = (panel * blocks + b) * kPanel;
      for (int r = 0; r < MR; ++r) {
        const int16_t* row = xq + (r * blocks + b) * kBlock;
        for (int j = 0; j < kPanel; ++j) {
          int32_t dot = 0;
          for (int p = 0; p < kPairs; ++p) {
            dot += W::at(blk, p, j, 0) * row[2 * p] + W::at(blk, p, j, 1) * row[2 * p + 1];
          }
          y[r][j] = std::fma(static_cast<float>(dot), w.d[si + j] * dx[r * blocks + b], y[r][j]);
          if constexpr (W::kHasMin) y[r][j] = std::fma(w.m[si + j], sx[r * blocks + b], y[r][j]);
        }
      }
    }
#endif
    const int64_t n0 = panel * kPanel;
    const int64_t valid = std::min(kPanel, n - n0);
    for (int r = 0; r < MR; ++r) {
      float* row = out + (m0 + r) * out_stride + n0;
      for (int64_t j = 0; j < valid; ++j) row[j] = y[r][j] + (bias != nullptr ? bias[n0 + j] : 0.f);
    }
  }
};

// tile.at<rows>(m0, panel), rows <= MR
template <int MR, typename Tile>
void block_rows_at(const Tile& tile, int64_t rows, int64_t m0, int64_t panel) {
  if constexpr (MR > 1) {
    if (rows < MR) return block_rows_at<MR - 1>(tile, rows, m0, panel);
  }
  tile.template at<MR>(m0, panel);
}

template <typename W>
void run(const char* op, const W& weights, int64_t panels, const at::Tensor& x,
         const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const int64_t n = out.dim() == 2 ? out.size(1) : 0;
  TORCH_CHECK(x.dim() == 2 && (x.size(1) + kBlock - 1) / kBlock == weights.blocks &&
                  (n + kPanel - 1) / kPanel == panels,
              op, ": q must be [ceil(N / 16), ceil(K / 32), ..] for x [M, K] and out [M, N]");
  shoal_tiles::check_rows(op, x, n, x.size(1), bias, out);
  const int64_t m = x.size(0);
  if (m == 0 || n == 0) return;
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // the rows in as few tiles of at most kMaxRows as there can be, of even sizes
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t tile_rows = (m + tiles - 1) / tiles;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const QuantizedRows& rows = shoal_blocks::quantize_rows(x, weights.blocks);
    const PanelTile<W> tile{weights, &rows, bias_data, out.data_ptr<float>(), out.stride(0), n};
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t m0 = 0; m0 < m; m0 += tile_rows) {
        block_rows_at<kMaxRows>(tile, std::min(tile_rows, m - m0), m0, panel);
      }
    }
  });
}

}  // namespace

namespace shoal_ops {

void q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3, "q8_linear: q must be [P, B, 512]");
  const int64_t panels = q.size(0), blocks = q.size(1);
  check_tensor("q8_linear", "q", q, at::kChar, {panels, blocks, Q8::kBlockBytes});
  check_tensor("q8_linear", "d", d, at::kFloat, {panels, blocks, kPanel});
  run("q8_linear", Q8{q.data_ptr<int8_t>(), d.data_ptr<float>(), blocks}, panels, x, bias, out);
}

void q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const at::Tensor& m, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && x.dim() == 2 && x.size(1) % kBlock == 0,
              "q4_linear: q must be [P, B, 256] for x [M, K] with K a multiple of 32");
  const int64_t panels = q.size(0), blocks = q.size(1);
  check_tensor("q4_linear", "q", q, at::kByte, {panels, blocks, Q4::kBlockBytes});
  check_tensor("q4_linear", "d", d, at::kFloat, {panels, blocks, kPanel});
  check_tensor("q4_linear", "m", m, at::kFloat, {panels, blocks, kPanel});
  const Q4 weights{q.data_ptr<uint8_t>(), d.data_ptr<float>(), blocks, m.data_ptr<float>()};
  run("q4_linear", weights, panels, x, bias, out);
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor d, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::q8_linear);
  m.def("q4_linear(Tensor x, Tensor q, Tensor d, Tensor m, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::q4_linear);
}
