// y = x w.T + b with int8 weights in blocks of 32 along K, one float32 scale per block, and
// float32 activations (weight-only quantization):
//
//   int8_linear(x, weight, scales, bias, out)
//     x       [M, K] float32, rows contiguous
//     weight  [N, K] int8, contiguous: block j of row n is weight[n, 32j : 32j + 32]
//     scales  [N, ceil(K / 32)] float32: w[n, k] = weight[n, k] * scales[n, k / 32]
//     bias    [N] float32 or None
//     out     [M, N] float32, rows contiguous
//
// A weight is turned into float32 exactly as `weight.float() * scale` in torch does (one
// rounding), then multiplied and added in float32. Reading a quarter of float32's bytes is what
// it is for: at a few rows a linear is bound by reading its weight.
//
// The tile: MR rows of x times NR output channels. For every eight k, each channel's eight
// weights are converted once and used for all MR rows; each row of x is loaded once and used for
// both channels. 4 x 2 accumulators stay in registers over all of K; a horizontal sum ends each.
// Threads split the channels; each thread walks its channels in chunks that stay in cache while
// every row of x passes over them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_INT8_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;          // weights per scale, along K
constexpr int64_t kRowsPerTile = 4;     // MR
constexpr int64_t kChannelsPerTile = 2; // NR
constexpr int64_t kChannelsPerChunk = 16;
constexpr int64_t kPrefetch = 2048;  // a chunk's weights (16 x K bytes) stay in L1/L2

#ifdef SHOAL_INT8_AVX2
inline float hsum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

inline __m256 weights8(const int8_t* w, __m256 scale) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
}
#endif

// out[m, n0 + c] for m < MR, c < NR.
template <int MR, int NR>
void tile(const float* x, int64_t x_stride, const int8_t* w, const float* scales, int64_t k_len,
          int64_t blocks, const float* bias, int64_t n0, float* out, int64_t out_stride) {
  float sums[MR][NR] = {};
#ifdef SHOAL_INT8_AVX2
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_setzero_ps();
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k_end = std::min(k_len, (b + 1) * kBlock);
    int64_t k = b * kBlock;
#ifdef SHOAL_INT8_AVX2
    __m256 scale[NR];
    for (int c = 0; c < NR; ++c) scale[c] = _mm256_set1_ps(scales[(n0 + c) * blocks + b]);
    for (; k + 8 <= k_end; k += 8) {
      if ((k & 63) == 0) {
        for (int c = 0; c < NR; ++c) __builtin_prefetch(w + (n0 + c) * k_len + k + kPrefetch, 0, 0);
      }
      __m256 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = weights8(w + (n0 + c) * k_len + k, scale[c]);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * x_stride + k);
        for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
      }
    }
#endif
    for (; k < k_end; ++k) {
      for (int c = 0; c < NR; ++c) {
        const float wk =
            static_cast<float>(w[(n0 + c) * k_len + k]) * scales[(n0 + c) * blocks + b];
        for (int m = 0; m < MR; ++m) sums[m][c] += x[m * x_stride + k] * wk;
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NR; ++c) {
      float y = sums[m][c];
#ifdef SHOAL_INT8_AVX2
      y += hsum(acc[m][c]);
#endif
      if (bias != nullptr) y += bias[n0 + c];
      out[m * out_stride + n0 + c] = y;
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, const float*, int64_t, int64_t,
                        const float*, int64_t, float*, int64_t);

template <int NR>
TileFn tile_for_rows(int64_t rows) {
  switch (rows) {
    case 1: return &tile<1, NR>;
    case 2: return &tile<2, NR>;
    case 3: return &tile<3, NR>;
    default: return &tile<4, NR>;
  }
}


void check_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "int8_linear: x must be a 2-d float32 CPU tensor with contiguous rows");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar &&
                  weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "int8_linear: weight must be a contiguous int8 [N, K] matching x [M, K]");
  const int64_t n = weight.size(0), blocks = (weight.size(1) + kBlock - 1) / kBlock;
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == blocks,
              "int8_linear: scales must be a contiguous float32 [N, ceil(K / 32)]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                "int8_linear: bias must be a contiguous float32 [N]");
  }
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == n,
              "int8_linear: out must be a float32 [M, N] with contiguous rows");
}

void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  check_args(x, weight, scales, bias, out);
  const int64_t rows = x.size(0), k_len = x.size(1), n = weight.size(0);
  const int64_t blocks = scales.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const float* x_data = x.data_ptr<float>();
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const int64_t chunks = (n + kChannelsPerChunk - 1) / kChannelsPerChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n_begin = chunk * kChannelsPerChunk;
      const int64_t n_end = std::min(n, n_begin + kChannelsPerChunk);
      for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerTile) {
        const int64_t mr = std::min(kRowsPerTile, rows - m0);
        const float* x_rows = x_data + m0 * x_stride;
        float* out_rows = out_data + m0 * out_stride;
        int64_t c = n_begin;
        const TileFn pair = tile_for_rows<kChannelsPerTile>(mr);
        for (; c + kChannelsPerTile <= n_end; c += kChannelsPerTile) {
          pair(x_rows, x_stride, w, s, k_len, blocks, b, c, out_rows, out_stride);
        }
        const TileFn rest = n_end - c == 2 ? tile_for_rows<2>(mr) : tile_for_rows<1>(mr);
        if (c < n_end) rest(x_rows, x_stride, w, s, k_len, blocks, b, c, out_rows, out_stride);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, Tensor(a!) out) -> ()",
        &int8_linear);
}
