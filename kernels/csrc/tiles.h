// What the linear kernels share (linear.cpp, block_linear.cpp): the horizontal sum, how a
// product's [M, N] output is cut into tiles and spread over threads, and the argument checks.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_LINEAR_AVX2 1
#endif

namespace shoal_tiles {

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

// Calls tile.template at<MR, NR>(m0, n0) over every tile of an [m, n] output: threads split
// the channels in chunks of 16; each chunk runs all rows, MR <= 4 at a time, NR channels at a
// time (4 when MR <= 2, else 2, and 1 for an odd last channel).
template <typename Tile>
void for_each_tile(int64_t m, int64_t n, const Tile& tile) {
  const int64_t chunks = (n + kChannelsPerChunk - 1) / kChannelsPerChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n_begin = chunk * kChannelsPerChunk;
      const int64_t n_end = std::min(n, n_begin + kChannelsPerChunk);
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerTile) {
        const int64_t mr = std::min(kRowsPerTile, m - m0);
        int64_t c = n_begin;
        auto rows = [&](auto nr) {
          constexpr int NR = decltype(nr)::value;
          switch (mr) {
            case 1: return tile.template at<1, NR>(m0, c);
            case 2: return tile.template at<2, NR>(m0, c);
            case 3: return tile.template at<3, NR>(m0, c);
            default: return tile.template at<4, NR>(m0, c);
          }
        };
        if (mr <= kWideRows) {
          for (; c + 4 <= n_end; c += 4) rows(std::integral_constant<int, 4>{});
        }
        for (; c + 2 <= n_end; c += 2) rows(std::integral_constant<int, 2>{});
        if (c < n_end) rows(std::integral_constant<int, 1>{});
      }
    }
  });
}

// x [M, K] float32 with contiguous rows; bias [N] float32 or None; out [M, N] float32 with
// contiguous rows.
inline void check_rows(const char* op, const at::Tensor& x, int64_t n, int64_t k,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1 && x.size(1) == k,
              op, ": x must be a 2-d float32 CPU tensor with contiguous rows of ", k);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
  }
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == n,
              op, ": out must be a float32 [M, N] with contiguous rows");
}

// A contiguous CPU tensor of that type and shape.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t,
                         at::ScalarType type, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
                  t.sizes() == shape,
              op, ": ", name, " must be a contiguous ", type, " ", shape, " CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace shoal_tiles
