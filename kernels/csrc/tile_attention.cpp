// Decode attention's two products on AMX tiles, for a bfloat16 KV cache (paged_decode.cpp's
// path where the CPU has AMX-BF16 and the OS grants the tiles; tile_attention.h says what
// each function takes). For one sequence and one KV head, with G query heads sharing it:
//
//   scores  S^T [keys, G] = K [keys, D] . Q^T   16 keys a tile product (tdpbf16ps): K as the
//           cache holds it, q rounded to bfloat16 (nearest even), sums in float32
//   values  O [G, D] = P [G, keys] . V          32 keys a product: P (the softmax's
//           unnormalized float32 weights) rounded to bfloat16, V's rows of two keys interleaved
//           (the tiles' pair layout), sums in float32; then O / sum(P) in float32
//
// Tiles: tmm0-3 O's accumulators [G, 16 floats] (64 of D's floats at a time), tmm4 P [G, 32
// keys], tmm5 a K block [16 keys, 32 of D] or a V block [16 key pairs, 16 of D, 2], tmm6 Q^T
// [16 pairs of D, G, 2], tmm7 S^T [16 keys, G]. Keys past the sequence are zero rows (a reused
// page's stale values never reach a sum). Built for every CPU; the AMX code is compiled with
// function target attributes and taken only where tiles_ready() says the CPU and OS allow it.

#include "tile_attention.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define SHOAL_TILES 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace shoal_tiles {

#ifdef SHOAL_TILES

namespace {

#define SHOAL_TILE_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state's use
constexpr int kXfeatureXtiledata = 18;     // the tiles' data

bool cpu_has_tiles() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx & (1u << 22)) != 0 && (edx & (1u << 24)) != 0;  // AMX-BF16, AMX-TILE
}

// The ldtilecfg operand: palette 1, each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline uint16_t bf16_nearest(float x) {  // nearest even, as c10::BFloat16 and torch's .to()
  return c10::BFloat16(x).x;
}

// Asks for rows[from .. to) (clipped to len), D bfloat16 values each, a cache line at a time:
// the next block's rows while this block's products run.
inline void prefetch_rows(const c10::BFloat16* const* rows, int64_t from, int64_t to,
                          int64_t len, int64_t dim) {
  for (int64_t t = from; t < std::min(to, len); ++t) {
    for (int64_t d = 0; d < dim; d += 32) __builtin_prefetch(rows[t] + d, 0, 3);
  }
}

}  // namespace

bool tiles_ready() {
  static const bool ready =
      cpu_has_tiles() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

SHOAL_TILE_TARGET void configure(int64_t group) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {  // O's accumulators and P: G rows of 64 bytes
    config.rows[t] = static_cast<uint8_t>(group);
    config.colsb[t] = 64;
  }
  config.rows[5] = 16;  // a K or V block
  config.colsb[5] = 64;
  for (int t = 6; t < 8; ++t) {  // Q^T and S^T: 16 rows of G floats (or pairs)
    config.rows[t] = 16;
    config.colsb[t] = static_cast<uint16_t>(group * 4);
  }
  // The compiler must not drop the stores above as unread (seen in llama.cpp's AMX code).
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

SHOAL_TILE_TARGET void release() { _tile_release(); }

SHOAL_TILE_TARGET void scores(const float* q, int64_t group, int64_t dim,
                              const c10::BFloat16* const* keys, int64_t key_stride, int64_t len,
                              float scale, float* out, int64_t out_stride, Scratch& scratch) {
  // Q^T in pairs: q_pairs[c][r][n][i] = q[n][32c + 2r + i]
  const int64_t chunks = dim / 32;
  scratch.q_pairs.resize(chunks * 16 * group * 2);
  uint16_t* qp = scratch.q_pairs.data();
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t r = 0; r < 16; ++r) {
      for (int64_t n = 0; n < group; ++n) {
        for (int64_t i = 0; i < 2; ++i) {
          qp[((c * 16 + r) * group + n) * 2 + i] = bf16_nearest(q[n * dim + c * 32 + 2 * r + i]);
        }
      }
    }
  }
  scratch.block.resize(16 * dim);
  uint16_t* block = scratch.block.data();
  float sums[16 * 16];
  prefetch_rows(keys, 0, 16, len, dim);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t rows = std::min<int64_t>(16, len - t0);
    prefetch_rows(keys, t0 + 16, t0 + 32, len, dim);
    // 16 keys in consecutive slots (a whole page's run) are read where they lie; else copied
    const bool in_place = rows == 16 && keys[t0 + 15] == keys[t0] + 15 * key_stride;
    const void* base = keys[t0];
    int64_t stride = key_stride * sizeof(uint16_t);
    if (!in_place) {
      for (int64_t i = 0; i < 16; ++i) {
        if (i < rows) {
          std::memcpy(block + i * dim, keys[t0 + i], dim * sizeof(uint16_t));
        } else {
          std::memset(block + i * dim, 0, dim * sizeof(uint16_t));
        }
      }
      base = block;
      stride = dim * sizeof(uint16_t);
    }
    _tile_zero(7);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(5, static_cast<const uint16_t*>(base) + c * 32, stride);
      _tile_loadd(6, qp + c * 16 * group * 2, group * 4);
      _tile_dpbf16ps(7, 5, 6);
    }
    _tile_stored(7, sums, group * 4);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t n = 0; n < group; ++n) {
        out[n * out_stride + t0 + i] = sums[i * group + n] * scale;
      }
    }
  }
}

SHOAL_TILE_TARGET void values(const float* probs, int64_t probs_stride, int64_t group,
                              int64_t len, const c10::BFloat16* const* rows, int64_t dim,
                              const float* inv_sum, float* const* out, Scratch& scratch) {
  const int64_t padded = (len + 31) / 32 * 32;
  scratch.probs.assign(group * padded, 0);
  uint16_t* p = scratch.probs.data();
  for (int64_t n = 0; n < group; ++n) {
    for (int64_t t = 0; t < len; ++t) p[n * padded + t] = bf16_nearest(probs[n * probs_stride + t]);
  }
  scratch.block.resize(4 * 16 * 32);  // up to 4 V blocks: [16 key pairs][16 of D][2]
  uint16_t* vb = scratch.block.data();
  const __m512i first_half = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second_half = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  float sums[16 * 64];
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int64_t tiles = std::min<int64_t>(4, (dim - d0) / 16);  // 2 or 4: D is whole 32s
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    prefetch_rows(rows, 0, 32, len, dim);
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      prefetch_rows(rows, t0 + 32, t0 + 64, len, dim);
      for (int64_t r = 0; r < 16; ++r) {  // keys t0 + 2r and t0 + 2r + 1, interleaved
        for (int64_t half = 0; half < tiles / 2; ++half) {
          const int64_t ta = t0 + 2 * r, tb = ta + 1;
          const __m512i a = ta < len ? _mm512_loadu_si512(rows[ta] + d0 + 32 * half)
                                     : _mm512_setzero_si512();
          const __m512i b = tb < len ? _mm512_loadu_si512(rows[tb] + d0 + 32 * half)
                                     : _mm512_setzero_si512();
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
          _mm512_storeu_si512(vb + ((2 * half) * 16 + r) * 32,
                              _mm512_permutex2var_epi64(lo, first_half, hi));
          _mm512_storeu_si512(vb + ((2 * half + 1) * 16 + r) * 32,
                              _mm512_permutex2var_epi64(lo, second_half, hi));
        }
      }
      _tile_loadd(4, p + t0, padded * sizeof(uint16_t));
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, vb + 16 * 32, 64);
      _tile_dpbf16ps(1, 4, 5);
      if (tiles == 4) {
        _tile_loadd(5, vb + 2 * 16 * 32, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vb + 3 * 16 * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, sums, 64 * sizeof(float));
    _tile_stored(1, sums + 16, 64 * sizeof(float));
    if (tiles == 4) {
      _tile_stored(2, sums + 32, 64 * sizeof(float));
      _tile_stored(3, sums + 48, 64 * sizeof(float));
    }
    for (int64_t n = 0; n < group; ++n) {
      for (int64_t x = 0; x < 16 * tiles; ++x) out[n][d0 + x] = sums[n * 64 + x] * inv_sum[n];
    }
  }
}

#else  // no AMX in this compiler: the vector path always

bool tiles_ready() { return false; }
void configure(int64_t) {}
void release() {}
void scores(const float*, int64_t, int64_t, const c10::BFloat16* const*, int64_t, int64_t, float,
            float*, int64_t, Scratch&) {}
void values(const float*, int64_t, int64_t, int64_t, const c10::BFloat16* const*, int64_t,
            const float*, float* const*, Scratch&) {}

#endif

}  // namespace shoal_tiles
