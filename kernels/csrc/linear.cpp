// Linears for the few-row steps that are bound by reading the weight (a decode of a few
// sequences reads every weight once per token):
//
//   int8_linear(x, weight, scales, bias, out)    weight int8 [N, K] in blocks of 32 along K,
//                                                scales float32 [N, ceil(K / 32)]:
//                                                w[n, k] = weight[n, k] * scales[n, k / 32]
//   f32_linear(x, weight, bias, out)             weight float32 [N, K]
//
//     x     [M, K] float32, rows contiguous       bias  [N] float32 or None
//     out   [M, N] float32, rows contiguous
//
// int8 weights become float32 exactly as `weight.float() * scale` in torch does (one rounding),
// then everything is multiplied and added in float32 (`quantization="int8"`, quant.py).
// f32_linear is what `PackedLinear` runs at a few rows: measured here (2-core AVX2 EPYC, all of
// SmolLM2's projections at one row) it read the weights at ~25 GB/s against ~19 for oneDNN.
//
// The tile: MR rows of x times NR output channels. For every eight k, each channel's eight
// weights are loaded (and converted) once and used for all MR rows; each row of x is loaded
// once and used for every channel. MR x NR accumulators stay in registers over all of K; a
// horizontal sum ends each. Threads split the channels in chunks of 16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_LINEAR_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;             // int8 weights per scale, along K
constexpr int64_t kRowsPerTile = 4;        // MR at most
constexpr int64_t kWideRows = 2;           // MR up to this: NR = 4, else 2 (registers)
constexpr int64_t kChannelsPerChunk = 16;  // a thread's unit of work

#ifdef SHOAL_LINEAR_AVX2
inline float hsum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
#endif

// int8 weights with a float32 scale per block of 32. Prefetched 2 KB ahead: the hardware
// prefetcher alone left the one-row case at ~14 GB/s (9.1 against 12.7 ms for SmolLM2).
struct Int8Weights {
  const int8_t* w;
  const float* scales;
  int64_t k_len, blocks;
  static constexpr int64_t kBlockLen = kBlock;
  static constexpr int64_t kPrefetchBytes = 2048;
  float scale(int64_t n, int64_t b) const { return scales[n * blocks + b]; }
  float at(int64_t n, int64_t k, float scale) const {
    return static_cast<float>(w[n * k_len + k]) * scale;
  }
  const void* row(int64_t n, int64_t k) const { return w + n * k_len + k; }
#ifdef SHOAL_LINEAR_AVX2
  __m256 load8(int64_t n, int64_t k, __m256 scale) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + n * k_len + k));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
  }
#endif
};

// float32 weights: one block spanning K, no scale; the hardware prefetcher keeps up.
struct FloatWeights {
  const float* w;
  int64_t k_len, blocks;
  static constexpr int64_t kBlockLen = INT64_MAX;
  static constexpr int64_t kPrefetchBytes = 0;
  float scale(int64_t, int64_t) const { return 1.f; }
  float at(int64_t n, int64_t k, float) const { return w[n * k_len + k]; }
  const void* row(int64_t n, int64_t k) const { return w + n * k_len + k; }
#ifdef SHOAL_LINEAR_AVX2
  __m256 load8(int64_t n, int64_t k, __m256) const { return _mm256_loadu_ps(w + n * k_len + k); }
#endif
};

struct Rows {
  const float* x;
  int64_t x_stride;
  const float* bias;
  float* out;
  int64_t out_stride;
};

// out[m, n0 + c] for m < MR, c < NR.
template <typename W, int MR, int NR>
void tile(const W& weights, const Rows& rows, int64_t n0) {
  const int64_t k_len = weights.k_len;
  float sums[MR][NR] = {};
#ifdef SHOAL_LINEAR_AVX2
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_setzero_ps();
#endif
  for (int64_t b = 0; b < weights.blocks; ++b) {
    const int64_t k_end = b * W::kBlockLen + std::min(k_len - b * W::kBlockLen, W::kBlockLen);
    int64_t k = b * W::kBlockLen;
    float scale[NR];
    for (int c = 0; c < NR; ++c) scale[c] = weights.scale(n0 + c, b);
#ifdef SHOAL_LINEAR_AVX2
    __m256 vscale[NR];
    for (int c = 0; c < NR; ++c) vscale[c] = _mm256_set1_ps(scale[c]);
    for (; k + 8 <= k_end; k += 8) {
      if (W::kPrefetchBytes > 0 && (k & 63) == 0) {
        for (int c = 0; c < NR; ++c) {
          const char* ahead = static_cast<const char*>(weights.row(n0 + c, k));
          __builtin_prefetch(ahead + W::kPrefetchBytes, 0, 0);
        }
      }
      __m256 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = weights.load8(n0 + c, k, vscale[c]);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(rows.x + m * rows.x_stride + k);
        for (int c = 0; c < NR; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
      }
    }
#endif
    for (; k < k_end; ++k) {
      for (int c = 0; c < NR; ++c) {
        const float wk = weights.at(n0 + c, k, scale[c]);
        for (int m = 0; m < MR; ++m) sums[m][c] += rows.x[m * rows.x_stride + k] * wk;
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NR; ++c) {
      float y = sums[m][c];
#ifdef SHOAL_LINEAR_AVX2
      y += hsum(acc[m][c]);
#endif
      if (rows.bias != nullptr) y += rows.bias[n0 + c];
      rows.out[m * rows.out_stride + n0 + c] = y;
    }
  }
}

template <typename W, int NR>
void tile_rows(int64_t mr, const W& weights, const Rows& rows, int64_t n0) {
  switch (mr) {
    case 1: return tile<W, 1, NR>(weights, rows, n0);
    case 2: return tile<W, 2, NR>(weights, rows, n0);
    case 3: return tile<W, 3, NR>(weights, rows, n0);
    default: return tile<W, 4, NR>(weights, rows, n0);
  }
}

template <typename W>
void run(const W& weights, int64_t n, int64_t m, const Rows& rows) {
  const int64_t chunks = (n + kChannelsPerChunk - 1) / kChannelsPerChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n_begin = chunk * kChannelsPerChunk;
      const int64_t n_end = std::min(n, n_begin + kChannelsPerChunk);
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerTile) {
        const int64_t mr = std::min(kRowsPerTile, m - m0);
        const Rows part{rows.x + m0 * rows.x_stride, rows.x_stride, rows.bias,
                        rows.out + m0 * rows.out_stride, rows.out_stride};
        int64_t c = n_begin;
        if (mr <= kWideRows) {
          for (; c + 4 <= n_end; c += 4) tile_rows<W, 4>(mr, weights, part, c);
        }
        for (; c + 2 <= n_end; c += 2) tile_rows<W, 2>(mr, weights, part, c);
        if (c < n_end) tile_rows<W, 1>(mr, weights, part, c);
      }
    }
  });
}

void check_rows(const char* op, const at::Tensor& x, const at::Tensor& weight,
                at::ScalarType weight_type, const std::optional<at::Tensor>& bias,
                const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, ": x must be a 2-d float32 CPU tensor with contiguous rows");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == weight_type &&
                  weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              op, ": weight must be a contiguous ", weight_type, " [N, K] matching x [M, K]");
  const int64_t n = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
  }
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == n,
              op, ": out must be a float32 [M, N] with contiguous rows");
}

Rows rows_of(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  return Rows{x.data_ptr<float>(), x.stride(0),
              bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
              out.stride(0)};
}

void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  check_rows("int8_linear", x, weight, at::kChar, bias, out);
  const int64_t n = weight.size(0), k_len = weight.size(1);
  const int64_t blocks = (k_len + kBlock - 1) / kBlock;
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == blocks,
              "int8_linear: scales must be a contiguous float32 [N, ceil(K / 32)]");
  const Int8Weights weights{weight.data_ptr<int8_t>(), scales.data_ptr<float>(), k_len, blocks};
  run(weights, n, x.size(0), rows_of(x, bias, out));
}

void f32_linear(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  check_rows("f32_linear", x, weight, at::kFloat, bias, out);
  const int64_t k_len = weight.size(1);
  const FloatWeights weights{weight.data_ptr<float>(), k_len, k_len > 0 ? 1 : 0};
  run(weights, weight.size(0), x.size(0), rows_of(x, bias, out));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, Tensor(a!) out) -> ()",
        &int8_linear);
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()", &f32_linear);
}
