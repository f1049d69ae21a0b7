// Decode attention's products on AMX tiles (tile_attention.cpp), for paged_decode.cpp's
// bfloat16 caches. A thread calls configure(G) before, and release() after, its scores and
// values calls, all for G query heads a KV head.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace shoal_tiles {

// A thread's buffers, reused from one call to the next.
struct Scratch {
  std::vector<uint16_t> q_pairs;  // Q^T in pairs of D
  std::vector<uint16_t> block;    // K rows, or V rows interleaved in pairs of keys
  std::vector<uint16_t> probs;    // P in bfloat16, [G, keys rounded up to 32]
};

// True where the CPU has AMX-BF16 and the OS granted this process the tiles (asked once).
bool tiles_ready();

// The tiles' shapes for G query heads (1 to 16) a KV head; release() gives them back.
void configure(int64_t group);
void release();

// out[n * out_stride + t] = (q[n] . keys[t]) * scale for the G heads n of q ([G, D] floats,
// D a multiple of 32) and the `len` key rows (D bfloat16 values each; two keys in consecutive
// slots are `key_stride` values apart).
void scores(const float* q, int64_t group, int64_t dim, const c10::BFloat16* const* keys,
            int64_t key_stride, int64_t len, float scale, float* out, int64_t out_stride,
            Scratch& scratch);

// out[n][d] = sum_t probs[n * probs_stride + t] * rows[t][d] * inv_sum[n] over the `len`
// value rows (D bfloat16 values each, D a multiple of 32).
void values(const float* probs, int64_t probs_stride, int64_t group, int64_t len,
            const c10::BFloat16* const* rows, int64_t dim, const float* inv_sum,
            float* const* out, Scratch& scratch);

}  // namespace shoal_tiles
