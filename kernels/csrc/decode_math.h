// The arithmetic of decode attention on the CPU, shared by paged_decode.cpp's one-sequence
// work items and decode_runs.h's runs of a speculating row's positions: each (query head, key)
// score, the softmax and the values' sums are done by these alone, in the same order wherever
// they are called, so that a position gives the same bits however its work is split.

#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace shoal_decode {

using Vec = at::vec::Vectorized<float>;
using at::BFloat16;

// Vec::size() cache values as float32: float32 as they are, bfloat16 widened (exact).
inline Vec load_floats(const float* p) { return Vec::loadu(p); }
inline Vec load_floats(const BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

// a . b over `dim` values: whole vectors in lanes, the rest (a head_dim that is not a multiple
// of the vector width) one by one.
template <typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= dim; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), load_floats(b + i), acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < dim; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

// acc += weight * x over `dim` values.
template <typename T>
inline void add_scaled(float weight, const T* x, float* acc, int64_t dim) {
  const Vec w(weight);
  int64_t i = 0;
  for (; i + Vec::size() <= dim; i += Vec::size()) {
    at::vec::fmadd(w, load_floats(x + i), Vec::loadu(acc + i)).store(acc + i);
  }
  for (; i < dim; ++i) acc[i] += weight * static_cast<float>(x[i]);
}

// row <- exp(row - max(row)); returns 1 / sum(row). The exp is ATen's exp_u20, as torch's own
// CPU flash attention uses.
inline float softmax_unnormalized(float* row, int64_t len) {
  Vec vmax(-std::numeric_limits<float>::infinity());  // the peak, a vector at a time
  int64_t m = 0;
  for (; m + Vec::size() <= len; m += Vec::size()) {
    vmax = at::vec::maximum(vmax, Vec::loadu(row + m));
  }
  float peak = at::vec::vec_reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
  for (; m < len; ++m) peak = std::max(peak, row[m]);
  const Vec vpeak(peak);
  Vec vtotal(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= len; t += Vec::size()) {
    const Vec e = (Vec::loadu(row + t) - vpeak).exp_u20();
    e.store(row + t);
    vtotal = vtotal + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vtotal);
  if (t < len) {
    const int64_t rest = len - t;
    const Vec e = (Vec::loadu(row + t, rest) - vpeak).exp_u20();
    e.store(row + t, rest);
    float tail[Vec::size()];
    e.store(tail, rest);
    for (int64_t i = 0; i < rest; ++i) total += tail[i];
  }
  return 1.f / total;
}

#if defined(CPU_CAPABILITY_AVX512)
// Four keys' dot products with one query (dim a whole number of 16s), each the bits of dot():
// the same fused multiply-adds, then the sum of the 16 lanes in vec_reduce_all's order (lanes
// i and i + 8, then i and i ^ 4, i ^ 2, i ^ 1), four keys' sums sharing each instruction.
template <typename T>
inline void dot4(const float* q, const T* const* keys, int64_t dim, float* out) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  for (int64_t i = 0; i < dim; i += Vec::size()) {
    const Vec qi = Vec::loadu(q + i);
    for (int k = 0; k < 4; ++k) acc[k] = at::vec::fmadd(qi, load_floats(keys[k] + i), acc[k]);
  }
  const __m512 a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
  // [a 0-7 | b 0-7] + [a 8-15 | b 8-15]
  const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // [a 0-3 | b 0-3 | c 0-3 | d 0-3] + their 4-7
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xDD));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (int k = 0; k < 4; ++k) out[k] = lanes[4 * k];
}

// Sixteen keys' dot products with one query, times `scale`, into out[0 .. 16): dot4's sums
// (vec_reduce_all's tree: lanes i and i + 8, then i ^ 4, i ^ 2, i ^ 1, so each the bits of
// dot()) for 16 keys at once, the last two levels in 128-bit lanes that hold four keys each, so
// that a key costs three instructions of sums, not six, and its scaled score leaves in a
// vector, not one float at a time.
template <typename T>
inline void dot16(const float* q, const T* const* keys, int64_t dim, float scale, float* out) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += Vec::size()) {
    const Vec qi = Vec::loadu(q + i);
    for (int k = 0; k < 16; ++k) acc[k] = at::vec::fmadd(qi, load_floats(keys[k] + i), Vec(acc[k]));
  }
  // [a 0-7 | b 0-7] + [a 8-15 | b 8-15]: key 2m's sums in 128-bit lanes 0, 1, key 2m + 1's in 2, 3
  __m512 pairs[8];
  for (int m = 0; m < 8; ++m) {
    const __m512 a = acc[2 * m], b = acc[2 * m + 1];
    pairs[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  // lanes i and i ^ 4: 128-bit lane l holds key 4m + l's four sums
  __m512 fours[4];
  for (int m = 0; m < 4; ++m) {
    const __m512 a = pairs[2 * m], b = pairs[2 * m + 1];
    fours[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // i ^ 2 within each 128-bit lane l: keys l and 4 + l (then 8 + l and 12 + l), two sums each
  const __m512 low = _mm512_add_ps(_mm512_shuffle_ps(fours[0], fours[1], 0x44),
                                   _mm512_shuffle_ps(fours[0], fours[1], 0xEE));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_ps(fours[2], fours[3], 0x44),
                                    _mm512_shuffle_ps(fours[2], fours[3], 0xEE));
  // i ^ 1: element 4 l + e is key 4 e + l; put them in key order
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(low, high, 0x88), _mm512_shuffle_ps(low, high, 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(order, sums), _mm512_set1_ps(scale)));
}

// The value rows of one KV head: key t's at base + slots[t] * stride.
template <typename T>
struct ValueRows {
  const T* base;
  const int64_t* slots;
  int64_t stride;
  const T* operator()(int64_t t) const { return base + slots[t] * stride; }
};

// acc_h += scores[h * stride + t] * row(t) for H heads of one KV head and keys t0 .. end - 1,
// the heads' DV x 16 sums held in registers between a load from and a store back to acc[h]
// (add_scaled's fused multiply-adds in the same order, so the same bits however the keys are
// split). The rows are asked for by the callers (row_stream.h, decode_runs.h's blocks).
template <typename T, int DV, int H>
void value_sums(const float* scores, int64_t stride, int64_t t0, int64_t end,
                const ValueRows<T>& row, float* acc) {
  constexpr int64_t dim = DV * Vec::size();
  // Raw vectors: an array of Vec GCC kept on the stack for bfloat16 rows, a load and a store
  // a multiply-add (64 sequences of 200 keys, SmolLM2's heads, 30 layers: 17.7 ms, 15.9 now).
  __m512 sums[H][DV];
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < DV; ++d) sums[h][d] = _mm512_loadu_ps(acc + h * dim + d * Vec::size());
  for (int64_t t = t0; t < end; ++t) {
    const T* values = row(t);
    __m512 v[DV];
    for (int d = 0; d < DV; ++d) v[d] = load_floats(values + d * Vec::size());
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(scores[h * stride + t]);
      for (int d = 0; d < DV; ++d) sums[h][d] = _mm512_fmadd_ps(w, v[d], sums[h][d]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + h * dim + d * Vec::size(), sums[h][d]);
}

// value_sums for h <= H heads (DV x (H + 1) of the 32 registers: H 6 at DV 4, 2 at 8)
template <typename T, int DV, int H>
void value_sums_for(int h, const float* scores, int64_t stride, int64_t t0, int64_t end,
                    const ValueRows<T>& row, float* acc) {
  if constexpr (H > 1) {
    if (h < H) return value_sums_for<T, DV, H - 1>(h, scores, stride, t0, end, row, acc);
  }
  value_sums<T, DV, H>(scores, stride, t0, end, row, acc);
}

// The most heads value_sums keeps in registers at once, for a head of 16 DV.
constexpr int kValueHeads4 = 6, kValueHeads8 = 2;
#endif

// Rows are scattered over pages, so the hardware prefetcher cannot see the next one coming:
// each loop asks for the row this many keys ahead (cold pages measured 2x slower without it).
constexpr int64_t kPrefetchAhead = 8;
constexpr int64_t kPrefetchAhead16 = 16;  // the sixteen-key loop's: one pass ahead
// ... and its K rows into L2 three passes ahead, so that more of them are on their way from
// memory than L1's misses can hold (SmolLM2's heads, 64 sequences of 250 bfloat16 keys on
// shuffled pages, 2 threads, Zen 5 EPYC: 0.589-0.590 ms a layer against 0.657-0.659; of 120
// keys 0.251-0.265 against 0.275-0.276; float32 0.892-0.894 against 0.933-0.956; four passes
// ahead the same as three; measured before row_stream.h took over heads of 64 and 128, so now
// for the other heads only)
constexpr int64_t kPrefetchL2Ahead16 = 48;
constexpr int64_t kLineBytes = 64;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  constexpr int64_t per_line = kLineBytes / static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < dim; i += per_line) __builtin_prefetch(row + i, 0, 3);
}

// The same into L2 only: in AVX-512 builds' four-key loop, the V rows, asked for while the
// scores are computed from the K rows, so that a thread waits on one stream of memory, not on
// two (SmolLM2's heads, 64 sequences of 256 tokens, 30 layers' caches, 2 threads, on the EPYC:
// 1.09-1.58 ms a layer before, 0.99-1.18 after in bfloat16; float32 2.38-3.05, 1.93-2.06). The
// AVX2 build's one-key loop keeps without: there it made bfloat16 slower (1.51-1.64 ms, 1.79-1.84).
template <typename T>
inline void prefetch_row_l2(const T* row, int64_t dim) {
  constexpr int64_t per_line = kLineBytes / static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < dim; i += per_line) __builtin_prefetch(row + i, 0, 2);
}

}  // namespace shoal_decode
