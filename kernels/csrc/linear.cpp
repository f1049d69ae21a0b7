// A float32 linear for the few-row steps that are bound by reading the weight (a decode of a
// few sequences reads every weight once per token):
//
//   f32_linear(x, weight, bias, out)    x [M, K] float32, rows contiguous
//                                       weight [N, K] float32, contiguous
//                                       bias [N] float32 or None
//                                       out [M, N] float32, rows contiguous
//
// It is what `PackedLinear` runs at a few rows (linear.py): measured here (2-core AVX2 EPYC,
// all of SmolLM2's projections at one row) it read the weights at ~25 GB/s against ~19 for
// oneDNN.
//
// The tile: MR rows of x times NR output channels. For every eight k, each channel's eight
// weights are loaded once and used for all MR rows; each row of x is loaded once and used for
// every channel. MR x NR accumulators stay in registers over all of K; a horizontal sum ends
// each. tiles.h cuts the output into tiles and threads.

#include <torch/library.h>

#include "ops.h"

#include "tiles.h"

namespace {

using shoal_tiles::for_each_tile;

struct FloatTile {
  const float* x;
  int64_t x_stride;
  const float* w;
  int64_t k_len;
  const float* bias;
  float* out;
  int64_t out_stride;

  // out[m0 + m, n0 + c] for m < MR, c < NR.
  template <int MR, int NR>
  void at(int64_t m0, int64_t n0) const {
    const float* xs = x + m0 * x_stride;
    const float* ws = w + n0 * k_len;
    float sums[MR][NR] = {};
    int64_t k = 0;
#ifdef SHOAL_LINEAR_AVX2
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_setzero_ps();
    for (; k + 8 <= k_len; k += 8) {
      __m256 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = _mm256_loadu_ps(ws + c * k_len + k);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(xs + m * x_stride + k);
        for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < NR; ++c) sums[m][c] = shoal_tiles::hsum(acc[m][c]);
#endif
    for (; k < k_len; ++k) {
      for (int c = 0; c < NR; ++c) {
        for (int m = 0; m < MR; ++m) sums[m][c] += xs[m * x_stride + k] * ws[c * k_len + k];
      }
    }
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < NR; ++c) {
        const float y = sums[m][c] + (bias != nullptr ? bias[n0 + c] : 0.f);
        out[(m0 + m) * out_stride + n0 + c] = y;
      }
    }
  }
};

}  // namespace

namespace shoal_ops {

void f32_linear(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 2 && weight.is_contiguous() && x.dim() == 2 &&
                  weight.size(1) == x.size(1),
              "f32_linear: weight must be a contiguous float32 [N, K] matching x [M, K]");
  const int64_t n = weight.size(0), k_len = weight.size(1);
  shoal_tiles::check_rows("f32_linear", x, n, k_len, bias, out);
  const FloatTile tile{x.data_ptr<float>(),
                       x.stride(0),
                       weight.data_ptr<float>(),
                       k_len,
                       bias.has_value() ? bias->data_ptr<float>() : nullptr,
                       out.data_ptr<float>(),
                       out.stride(0)};
  for_each_tile(x.size(0), n, tile);
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()", &shoal_ops::f32_linear);
}
