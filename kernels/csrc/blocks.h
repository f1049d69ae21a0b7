// The blocks of quant.py's `quantization="int8"`, for block_linear.cpp: the two weight formats
// (Q8: int8 and a scale a block of 32; Q4: GGUF Q4_1's 4-bit weights, a scale and a minimum),
// the rows of x quantized to int16 per block of 32, and a block given back as float32.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tiles.h"

namespace shoal_blocks {

constexpr int64_t kBlock = 32;
constexpr float kLevels = 32767.f;  // x's largest |value| in a block maps to this

// x quantized: int16 [M, B * 32], the scale and the float sum of each block [M, B].
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

// One block of 32 floats (a short last block is padded with zeros by the caller).
inline void quantize_block(const float* p, int16_t* q, float* scale, float* sum) {
#ifdef SHOAL_LINEAR_AVX2
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 most = _mm256_max_ps(
      _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  *scale = amax > 0.f ? amax / kLevels : 1.f;
  const __m256 inverse = _mm256_set1_ps(1.f / *scale);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // packs works within 128-bit lanes: a cross-lane permute puts the 16 values back in order
  const __m256i low = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0xD8);
  const __m256i high = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), high);
  *sum = shoal_tiles::hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
#else
  float amax = 0.f, total = 0.f;
  for (int i = 0; i < kBlock; ++i) {
    amax = std::max(amax, std::abs(p[i]));
    total += p[i];
  }
  *scale = amax > 0.f ? amax / kLevels : 1.f;
  const float inverse = 1.f / *scale;
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int16_t>(std::nearbyint(p[i] * inverse));
  *sum = total;
#endif
}

// Per thread, reused: a decode step quantizes ~200 small x and allocating each showed.
inline const QuantizedRows& quantize_rows(const at::Tensor& x, int64_t blocks) {
  thread_local QuantizedRows rows;
  const int64_t m = x.size(0), k_len = x.size(1), stride = x.stride(0);
  rows.q.resize(m * blocks * kBlock);
  rows.scale.resize(m * blocks);
  rows.sum.resize(m * blocks);
  const float* data = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = data + r * stride + b * kBlock;
      float tail[kBlock] = {};
      if ((b + 1) * kBlock > k_len) {
        std::copy(p, p + (k_len - b * kBlock), tail);
        p = tail;
      }
      const int64_t at = r * blocks + b;
      quantize_block(p, rows.q.data() + at * kBlock, &rows.scale[at], &rows.sum[at]);
    }
  }
  return rows;
}

// int8 weights: 32 bytes a block.
struct Q8 {
  const int8_t* q;
  const float* d;
  int64_t blocks;
  static constexpr bool kHasMin = false;
  static constexpr int64_t kBlockBytes = 32;
  const char* block(int64_t n, int64_t b) const {
    return reinterpret_cast<const char*>(q) + (n * blocks + b) * kBlockBytes;
  }
  float min(int64_t, int64_t) const { return 0.f; }
  int16_t at(int64_t n, int64_t b, int i) const { return block(n, b)[i]; }
#ifdef SHOAL_LINEAR_AVX2
  void unpack(int64_t n, int64_t b, __m256i& low, __m256i& high) const {
    const char* p = block(n, b);
    low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    high = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
#endif
};

// 4-bit weights and a minimum: 16 bytes a block.
struct Q4 {
  const uint8_t* q;
  const float* d;
  const float* m;
  int64_t blocks;
  static constexpr bool kHasMin = true;
  static constexpr int64_t kBlockBytes = 16;
  const char* block(int64_t n, int64_t b) const {
    return reinterpret_cast<const char*>(q) + (n * blocks + b) * kBlockBytes;
  }
  float min(int64_t n, int64_t b) const { return m[n * blocks + b]; }
  int16_t at(int64_t n, int64_t b, int i) const {
    const uint8_t byte = static_cast<uint8_t>(block(n, b)[i % 16]);
    return i < 16 ? (byte & 0x0F) : (byte >> 4);
  }
#ifdef SHOAL_LINEAR_AVX2
  void unpack(int64_t n, int64_t b, __m256i& low, __m256i& high) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block(n, b)));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    low = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, nibble));
    high = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  }
#endif
};

// One block of 32 weights as float32, one rounding each (w = q * d, then + m).
template <typename W>
void dequantize_block(const W& weights, int64_t n, int64_t b, float* row, int64_t len) {
  const float d = weights.d[n * weights.blocks + b];
  const float m = weights.min(n, b);
#ifdef SHOAL_LINEAR_AVX2
  if (len == kBlock) {
    __m256i halves[2];
    weights.unpack(n, b, halves[0], halves[1]);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int h = 0; h < 2; ++h) {
      const __m256i lanes[2] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(halves[h])),
                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(halves[h], 1))};
      for (int j = 0; j < 2; ++j) {
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(lanes[j]), vd);
        if (W::kHasMin) w = _mm256_add_ps(w, vm);
        _mm256_storeu_ps(row + 16 * h + 8 * j, w);
      }
    }
    return;
  }
#endif
  for (int i = 0; i < len; ++i) {
    const float w = static_cast<float>(weights.at(n, b, i)) * d;
    row[i] = W::kHasMin ? w + m : w;
  }
}

template <typename W>
inline void dequantize_into(const W& weights, int64_t n, const at::Tensor& out) {
  const int64_t k_len = out.size(1);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, shoal_tiles::kChannelsPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t b = 0; b < weights.blocks; ++b) {
        const int64_t len = std::min(kBlock, k_len - b * kBlock);
        dequantize_block(weights, c, b, dst + c * k_len + b * kBlock, len);
      }
    }
  });
}

}  // namespace shoal_blocks
