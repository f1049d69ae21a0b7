// The blocks of quant.py's `quantization="int8"`, for block_linear.cpp: the two weight formats
// (Q8: int8 and a scale a block of 32; Q4: GGUF Q4_1's 4-bit weights, a scale and a minimum),
// both in panels of 16 output channels, and the rows of x quantized to int16 per block of 32.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SHOAL_BLOCKS_512 1
#endif

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

// The weights in panels of 16 output channels (quant.py lays them out): a block of a panel is
// its 16 channels' 32 weights along K, kept by pairs of K (k = 2p, 2p + 1, p < 16): pair p is 16
// channels x 2 weights, channel j's two at 2j and 2j + 1, so that one vpmaddwd of pair p against
// x's pair p broadcast gives the 16 channels' partial sums in its 16 lanes. Blocks follow each
// other along K within a panel, panels along N (N padded to 16 with zero weights and scales).
constexpr int64_t kPanel = 16;           // output channels a panel
constexpr int64_t kPairs = kBlock / 2;   // pairs of K a block

// Q8: int8, pair p at byte 32 p of the block: 512 bytes a block.
struct Q8 {
  const int8_t* q;
  const float* d;  // [P, B, 16]
  int64_t blocks;
  const float* m = nullptr;
  static constexpr bool kHasMin = false;
  static constexpr int64_t kBlockBytes = kPanel * kBlock;
  const uint8_t* block(int64_t panel, int64_t b) const {
    return reinterpret_cast<const uint8_t*>(q) + (panel * blocks + b) * kBlockBytes;
  }
  // the weight of channel j, k = 2 p + h, of a block
  static int32_t at(const uint8_t* blk, int p, int j, int h) {
    return static_cast<int8_t>(blk[32 * p + 2 * j + h]);
  }
#ifdef SHOAL_LINEAR_AVX2
  // f(p, pair p as int16) for the block's 16 pairs: channels 8 half .. 8 half + 7
  template <typename F>
  static void half_pairs(const uint8_t* blk, int half, F&& f) {
    for (int p = 0; p < kPairs; ++p) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * p + 16 * half));
      f(p, _mm256_cvtepi8_epi16(bytes));
    }
  }
#endif
#ifdef SHOAL_BLOCKS_512
  // the same, all 16 channels
  template <typename F>
  static void pairs(const uint8_t* blk, F&& f) {
    for (int p = 0; p < kPairs; ++p) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * p));
      f(p, _mm512_cvtepi8_epi16(bytes));
    }
  }
#endif
};

// Q4: GGUF Q4_1's 4-bit weights (0 .. 15) and a minimum, w = q * d + m: 256 bytes a block,
// byte i of group g (g < 8, at byte 32 g) holding pair g's byte i in its low nibble and pair
// g + 8's in its high one.
struct Q4 {
  const uint8_t* q;
  const float* d;  // [P, B, 16]
  int64_t blocks;
  const float* m;  // [P, B, 16]
  static constexpr bool kHasMin = true;
  static constexpr int64_t kBlockBytes = kPanel * kBlock / 2;
  const uint8_t* block(int64_t panel, int64_t b) const { return q + (panel * blocks + b) * kBlockBytes; }
  static int32_t at(const uint8_t* blk, int p, int j, int h) {
    const uint8_t byte = blk[32 * (p % 8) + 2 * j + h];
    return p < 8 ? (byte & 0x0F) : (byte >> 4);
  }
#ifdef SHOAL_LINEAR_AVX2
  template <typename F>
  static void half_pairs(const uint8_t* blk, int half, F&& f) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int g = 0; g < kPairs / 2; ++g) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * g + 16 * half));
      f(g, _mm256_cvtepu8_epi16(_mm_and_si128(bytes, nibble)));
      f(g + 8, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)));
    }
  }
#endif
#ifdef SHOAL_BLOCKS_512
  template <typename F>
  static void pairs(const uint8_t* blk, F&& f) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < kPairs / 2; ++g) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * g));
      f(g, _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble)));
      f(g + 8, _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)));
    }
  }
#endif
};

}  // namespace shoal_blocks
