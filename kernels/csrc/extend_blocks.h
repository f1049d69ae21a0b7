// The vector building blocks of paged_extend.cpp's prompt-chunk attention, in ATen's vector
// type for the build's capability (16 float lanes on AVX-512, 8 on AVX2): a cache row widened
// into a block's buffer, the scores of a block of keys against a work item's query rows held
// transposed (S^T = K Q^T: a key's element broadcast against a vector of rows), and the
// probabilities' weighted sum of the values into the rows' outputs with the sums in registers.

#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace shoal_extend {

using Vec = at::vec::Vectorized<float>;
using at::BFloat16;

constexpr int64_t kLanes = Vec::size();
constexpr int kRowVectors = 3;                   // query rows a pass of the scores: 3 vectors
constexpr int64_t kKeyBlock = 32;                // keys a block of the online softmax
constexpr int kOutRows = kLanes >= 16 ? 4 : 2;   // O's rows a pass (4 x 4 vectors: 16 zmm)
constexpr int kOutVectors = 4;                   // O's vectors a row a pass
constexpr float kMasked = -1e30f;                // a masked score before its exp (then 0)

// n values of a cache row as float32 into dst, zeros after them up to `padded`.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n, int64_t padded) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BFloat16>) {
    for (; i + kLanes <= n; i += kLanes) {
      Vec v;
      at::vec::load_to_float(src + i, v);
      v.store(dst + i);
    }
  } else {
    for (; i + kLanes <= n; i += kLanes) Vec::loadu(src + i).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  for (; i < padded; ++i) dst[i] = 0.f;
}

// s[j, v0 * L ..] = the query rows' scores against key j of the block (S^T), NV vectors of rows.
template <int NV>
void score_keys(const float* qt, int64_t rows, int64_t v0, const float* keys, int64_t dim,
                int64_t num_keys, float* s) {
  int64_t j = 0;
  for (; j + 4 <= num_keys; j += 4) {
    Vec acc[4][NV];
    for (int k = 0; k < 4; ++k)
      for (int v = 0; v < NV; ++v) acc[k][v] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      Vec qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = Vec::loadu(qt + d * rows + (v0 + v) * kLanes);
      for (int k = 0; k < 4; ++k) {
        const Vec kd(keys[(j + k) * dim + d]);
        for (int v = 0; v < NV; ++v) acc[k][v] = at::vec::fmadd(kd, qv[v], acc[k][v]);
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int v = 0; v < NV; ++v) acc[k][v].store(s + (j + k) * rows + (v0 + v) * kLanes);
  }
  for (; j < num_keys; ++j) {
    Vec acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const Vec kd(keys[j * dim + d]);
      for (int v = 0; v < NV; ++v) {
        acc[v] = at::vec::fmadd(kd, Vec::loadu(qt + d * rows + (v0 + v) * kLanes), acc[v]);
      }
    }
    for (int v = 0; v < NV; ++v) acc[v].store(s + j * rows + (v0 + v) * kLanes);
  }
}

// o[m .. m + R, c0 * L .. (c0 + C) * L] = o * corr + sum_j p[j, m + r] * values[j]
template <int R, int C>
void add_values(float* o, int64_t dim, const float* p, int64_t rows, int64_t m,
                const float* values, int64_t num_keys, int64_t c0, const float* corr) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r) {
    const Vec scale(corr[m + r]);
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::loadu(o + (m + r) * dim + (c0 + c) * kLanes) * scale;
  }
  for (int64_t j = 0; j < num_keys; ++j) {
    Vec v[C];
    for (int c = 0; c < C; ++c) v[c] = Vec::loadu(values + j * dim + (c0 + c) * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec w(p[j * rows + m + r]);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c].store(o + (m + r) * dim + (c0 + c) * kLanes);
}

template <int R>
void add_values_row_block(float* o, int64_t dim, const float* p, int64_t rows, int64_t m,
                          const float* values, int64_t num_keys, const float* corr) {
  const int64_t vectors = dim / kLanes;
  int64_t c0 = 0;
  for (; c0 + kOutVectors <= vectors; c0 += kOutVectors) {
    add_values<R, kOutVectors>(o, dim, p, rows, m, values, num_keys, c0, corr);
  }
  switch (vectors - c0) {
    case 3: add_values<R, 3>(o, dim, p, rows, m, values, num_keys, c0, corr); break;
    case 2: add_values<R, 2>(o, dim, p, rows, m, values, num_keys, c0, corr); break;
    case 1: add_values<R, 1>(o, dim, p, rows, m, values, num_keys, c0, corr); break;
    default: break;
  }
}

}  // namespace shoal_extend
