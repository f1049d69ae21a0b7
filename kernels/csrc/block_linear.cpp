// Linears over weights in blocks of 32 along K, for `quantization="int8"` (quant.py):
//
//   q8_linear(x, q, d, bias, out)      q int8 [N, B * 32], d float32 [N, B]:
//                                      w[n, k] = q[n, k] * d[n, k / 32]
//   q4_linear(x, q, d, m, bias, out)   q uint8 [N, B * 16], two weights a byte in GGUF Q4_1's
//                                      order (byte j of a block: k = j low, k = j + 16 high);
//                                      d, m float32 [N, B]: w[n, k] = q * d[n, k / 32] + m[..]
//
//     x [M, K] float32, rows contiguous, B = ceil(K / 32) (q4: K = 32 B); weights past K are 0
//     bias [N] float32 or None; out [M, N] float32, rows contiguous
//
// x is quantized per row and block of 32 to int16 (scale = the block's max |x| / 32767,
// rounded to nearest): 15 bits, an error of at most 1.5e-5 of the block's largest value, where
// 8 bits cost SmolLM2 3% of its top-1 agreement (bench/README.md). Each block's product is
// summed exactly in int32 (vpmaddwd; with VNNI, AVX-512 builds, the second half of a block
// added by vpdpwssd: the same sums), then scaled by both scales in float32:
//   y[m, n] = sum_b d[n, b] * dx[m, b] * sum_k q[n, k] * xq[m, k]   (+ m[n, b] * sum_k x[m, k])
// Q4_1's minimum multiplies the block's sum of the float x. Weights are prefetched 2 KB ahead.
// The tiles and threads are tiles.h's.
//
// They are for the few-row steps that read the weights more than they compute; from
// quant.MANY_ROWS rows on, `Int8Linear` multiplies the dequantized weight kept in float32
// panels instead (linear.cpp).
//
//   q8_dequantize(q, d, out)  /  q4_dequantize(q, d, m, out)    out [N, K] float32
//
// give the float32 weight back (q * d, q * d + m, one rounding each).

#include <torch/library.h>

#include "ops.h"

#include "blocks.h"
#include "tiles.h"

namespace {

using shoal_tiles::check_tensor;

using shoal_blocks::kBlock;
using shoal_blocks::Q4;
using shoal_blocks::Q8;
using shoal_blocks::QuantizedRows;

constexpr int64_t kPrefetchBytes = 2048;

template <typename W>
struct BlockTile {
  W w;
  const QuantizedRows* x;
  const float* bias;
  float* out;
  int64_t out_stride;

  // out[m0 + r, n0 + c] for r < MR, c < NR.
  template <int MR, int NR>
  void at(int64_t m0, int64_t n0) const {
    const int64_t blocks = w.blocks;
    const int16_t* xq = x->q.data() + m0 * blocks * kBlock;
    const float* dx = x->scale.data() + m0 * blocks;
    float sums[MR][NR] = {};
#ifdef SHOAL_LINEAR_AVX2
    __m256 acc[MR][NR];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      if (((b * W::kBlockBytes) & 63) == 0) {
        for (int c = 0; c < NR; ++c) __builtin_prefetch(w.block(n0 + c, b) + kPrefetchBytes, 0, 0);
      }
      for (int c = 0; c < NR; ++c) {
        __m256i low, high;
        w.unpack(n0 + c, b, low, high);
        const __m256 dw = _mm256_broadcast_ss(w.d + (n0 + c) * blocks + b);
        for (int r = 0; r < MR; ++r) {
          const int16_t* p = xq + (r * blocks + b) * kBlock;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
#ifdef SHOAL_VNNI
          // VNNI: the second half's products summed into the first's in one instruction
          const __m256i dot = _mm256_dpwssd_epi32(_mm256_madd_epi16(low, x0), high, x1);
#else
          const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x0), _mm256_madd_epi16(high, x1));
#endif
          const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dw);
          acc[r][c] = _mm256_fmadd_ps(scaled, _mm256_broadcast_ss(dx + r * blocks + b), acc[r][c]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) sums[r][c] = shoal_tiles::hsum(acc[r][c]);
#else
    for (int64_t b = 0; b < blocks; ++b) {
      for (int c = 0; c < NR; ++c) {
        const float dw = w.d[(n0 + c) * blocks + b];
        for (int r = 0; r < MR; ++r) {
          const int16_t* p = xq + (r * blocks + b) * kBlock;
          int32_t dot = 0;
          for (int i = 0; i < kBlock; ++i) dot += int32_t{w.at(n0 + c, b, i)} * p[i];
          sums[r][c] += static_cast<float>(dot) * dw * dx[r * blocks + b];
        }
      }
    }
#endif
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NR; ++c) {
        float y = sums[r][c] + (bias != nullptr ? bias[n0 + c] : 0.f);
        if constexpr (W::kHasMin) y += min_term(n0 + c, m0 + r);
        out[(m0 + r) * out_stride + n0 + c] = y;
      }
    }
  }

  // sum_b m[n, b] * (the sum of x[row]'s block b)
  float min_term(int64_t n, int64_t row) const {
    const int64_t blocks = w.blocks;
    const float* mins = w.m + n * blocks;
    const float* sums = x->sum.data() + row * blocks;
    float total = 0.f;
    int64_t b = 0;
#ifdef SHOAL_LINEAR_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= blocks; b += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(sums + b), acc);
    }
    total = shoal_tiles::hsum(acc);
#endif
    for (; b < blocks; ++b) total += mins[b] * sums[b];
    return total;
  }
};

template <typename W>
void dequantize(const char* op, const W& weights, int64_t n, const at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == n &&
                  (out.size(1) + kBlock - 1) / kBlock == weights.blocks,
              op, ": out must be a contiguous float32 [N, K] for the blocks");
  shoal_blocks::dequantize_into(weights, n, out);
}

template <typename W>
void run(const char* op, const W& weights, int64_t n, int64_t k_len, const at::Tensor& x,
         const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  shoal_tiles::check_rows(op, x, n, k_len, bias, out);
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const QuantizedRows& rows = shoal_blocks::quantize_rows(x, weights.blocks);
  const BlockTile<W> tile{weights, &rows, bias_data, out.data_ptr<float>(), out.stride(0)};
  shoal_tiles::for_each_tile(x.size(0), n, tile);
}

}  // namespace

namespace shoal_ops {

void q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 2 && x.dim() == 2 && q.size(1) % kBlock == 0 &&
                  q.size(1) / kBlock == (x.size(1) + kBlock - 1) / kBlock,
              "q8_linear: q must be [N, 32 * ceil(K / 32)] for x [M, K]");
  const int64_t n = q.size(0), blocks = q.size(1) / kBlock;
  check_tensor("q8_linear", "q", q, at::kChar, {n, blocks * kBlock});
  check_tensor("q8_linear", "d", d, at::kFloat, {n, blocks});
  const Q8 weights{q.data_ptr<int8_t>(), d.data_ptr<float>(), blocks};
  run("q8_linear", weights, n, x.size(1), x, bias, out);
}

void q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const at::Tensor& m, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 2 && x.dim() == 2 && x.size(1) % kBlock == 0 &&
                  q.size(1) * 2 == x.size(1),
              "q4_linear: q must be [N, K / 2] for x [M, K] with K a multiple of 32");
  const int64_t n = q.size(0), blocks = x.size(1) / kBlock;
  check_tensor("q4_linear", "q", q, at::kByte, {n, blocks * 16});
  check_tensor("q4_linear", "d", d, at::kFloat, {n, blocks});
  check_tensor("q4_linear", "m", m, at::kFloat, {n, blocks});
  const Q4 weights{q.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), blocks};
  run("q4_linear", weights, n, x.size(1), x, bias, out);
}

void q8_dequantize(const at::Tensor& q, const at::Tensor& d, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 2 && q.size(1) % kBlock == 0, "q8_dequantize: q must be [N, B * 32]");
  const int64_t n = q.size(0), blocks = q.size(1) / kBlock;
  check_tensor("q8_dequantize", "q", q, at::kChar, {n, blocks * kBlock});
  check_tensor("q8_dequantize", "d", d, at::kFloat, {n, blocks});
  dequantize("q8_dequantize", Q8{q.data_ptr<int8_t>(), d.data_ptr<float>(), blocks}, n,
             out);
}

void q4_dequantize(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                   const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 2 && q.size(1) % 16 == 0, "q4_dequantize: q must be [N, B * 16]");
  const int64_t n = q.size(0), blocks = q.size(1) / 16;
  check_tensor("q4_dequantize", "q", q, at::kByte, {n, blocks * 16});
  check_tensor("q4_dequantize", "d", d, at::kFloat, {n, blocks});
  check_tensor("q4_dequantize", "m", m, at::kFloat, {n, blocks});
  const Q4 weights{q.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), blocks};
  dequantize("q4_dequantize", weights, n, out);
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor d, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::q8_linear);
  m.def("q4_linear(Tensor x, Tensor q, Tensor d, Tensor m, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::q4_linear);
  m.def("q8_dequantize(Tensor q, Tensor d, Tensor(a!) out) -> ()", &shoal_ops::q8_dequantize);
  m.def("q4_dequantize(Tensor q, Tensor d, Tensor m, Tensor(a!) out) -> ()", &shoal_ops::q4_dequantize);
}
