// A speculating row's positions in paged_decode (AVX-512 builds): a verification of k drafts
// is 1 + k sequences of the step's batch with the same pages and lengths L, L + 1, .. L + k,
// each its own query row. They read the same keys but their last few, so a work item here takes
// one KV head of several of them at once, a block of keys at a time: the block's K (then V)
// rows come from memory or L2 once, are asked for once, and are read from L1 for every
// position after the first. Each (position, query head) is scored, softmaxed and summed by
// decode_math.h's functions in the order the one-sequence items use (dot16, dot4 or dot, all
// the bits of dot(); the values' multiply-adds in key order, held in memory between blocks), so
// a position's output is the bits of decoding it alone.
//
// On SmolLM2's heads (9 query heads, 3 KV heads of 64), a row of 400 keys and 12 drafts, 30
// layers' float32 caches, 2 threads of a Zen 5 EPYC: 13 positions 3.26-3.52 ms as one-sequence
// items with dot4, 2.17 with dot16 and a thread's keys just read not asked for again (since
// dropped: runs read them once), 1.76-1.89 in runs; 5 positions 1.63-1.77, 0.87-0.94 in runs;
// a bfloat16 cache's 13 positions 2.92-2.99, 1.91-1.97 as items after the values' fix
// (decode_math.h), 1.75-1.82 in runs. Not on the AMX tiles.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decode_math.h"
#include "key_slots.h"

#if defined(CPU_CAPABILITY_AVX512)

namespace shoal_decode {

// paged_decode's tensors as pointers (paged_decode.cpp documents them)
template <typename T>
struct DecodeArgs {
  const float* q;
  int64_t q_stride;
  const T* k;
  const T* v;
  int64_t slot_stride;  // Hkv * D
  float* out;
  int64_t out_stride;
  const int64_t* pages;
  int64_t max_pages;
  int64_t page_size;
  const int64_t* lens;
  const int64_t* tokens;
  int64_t group;  // query heads a KV head
  float scale;
};

// Sequences first .. first + count - 1 of the batch: one row's positions.
struct Run {
  int64_t first, count;
};

// One work item: KV head `kv` of a run's positions first .. first + count - 1.
struct RunItem {
  int64_t first, count, kv;
};

// Positions a work item takes at most (its scores: this x group x keys floats).
constexpr int64_t kRunPositions = 8;
// Keys a block of the values' pass: their V rows (8 KB at D 64 in float32) stay in L1 while
// every position of the item sums them.
constexpr int64_t kValueBlock = 32;

// The batch's runs of two or more: sequence b + 1 continues b's when it has one key more and
// its keys lie on the same pages.
template <typename T>
std::vector<Run> find_runs(const DecodeArgs<T>& a, int64_t batch) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < batch;) {
    int64_t e = b + 1;
    for (; e < batch && a.lens[e] == a.lens[e - 1] + 1; ++e) {
      const int64_t used = (a.lens[e] + a.page_size - 1) / a.page_size;
      const int64_t* mine = a.pages + e * a.max_pages;
      if (!std::equal(mine, mine + used, a.pages + (e - 1) * a.max_pages)) break;
    }
    if (e - b >= 2) runs.push_back({b, e - b});
    b = e;
  }
  return runs;
}

// The runs' work items: each KV head of each run, its positions in as few even chunks of at
// most kRunPositions as give every thread two items where the run can.
inline std::vector<RunItem> run_items(const std::vector<Run>& runs, int64_t kv_heads) {
  std::vector<RunItem> items;
  const int64_t want = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  for (const Run& run : runs) {
    const int64_t chunks = std::min(
        run.count, std::max((run.count + kRunPositions - 1) / kRunPositions, want));
    const int64_t size = (run.count + chunks - 1) / chunks;
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      for (int64_t p = 0; p < run.count; p += size) {
        items.push_back({run.first + p, std::min(size, run.count - p), kv});
      }
    }
  }
  return items;
}

// A work item's buffers, kept across its thread's items.
struct RunScratch {
  std::vector<int64_t> slots;  // the longest position's keys' slots
  std::vector<float> scores;   // [positions, group, longest]: logits, then probabilities
  std::vector<float> acc;      // [positions, group, D]: the values' sums between blocks
  std::vector<float> inv_sum;  // [positions, group]
};

// KV head `kv` of positions first .. first + n - 1 (lengths increasing by one), D = 16 DV.
template <typename T, int DV>
void run_heads(const DecodeArgs<T>& a, const RunItem& item, RunScratch& s) {
  constexpr int64_t dim = DV * Vec::size();
  constexpr int most = DV == 4 ? kValueHeads4 : kValueHeads8;
  const int64_t n = item.count, group = a.group, kv = item.kv;
  const int64_t* lens = a.lens + item.first;
  const int64_t longest = lens[n - 1], width = n * group;
  const int64_t* row_pages = a.pages + (item.first + n - 1) * a.max_pages;
  key_slots(row_pages, a.page_size, 0, longest, s.slots);
  auto k_row = [&](int64_t t) { return a.k + s.slots[t] * a.slot_stride + kv * dim; };
  const ValueRows<T> v_rows{a.v + kv * dim, s.slots.data(), a.slot_stride};
  auto query = [&](int64_t p, int64_t j) {
    return a.q + a.tokens[item.first + p] * a.q_stride + (kv * group + j) * dim;
  };
  s.scores.resize(width * longest);
  for (int64_t t = 0; t < std::min<int64_t>(16, longest); ++t) prefetch_row(k_row(t), dim);
  for (int64_t t = 0; t < longest; t += 16) {
    for (int64_t i = t + 16; i < std::min(t + 32, longest); ++i) {
      prefetch_row(k_row(i), dim);
      prefetch_row_l2(v_rows(i), dim);
    }
    const T* keys[16];
    for (int64_t i = 0; i < std::min<int64_t>(16, longest - t); ++i) keys[i] = k_row(t + i);
    for (int64_t p = 0; p < n; ++p) {
      const int64_t len = lens[p];
      if (t >= len) continue;
      for (int64_t j = 0; j < group; ++j) {
        float* row = s.scores.data() + (p * group + j) * longest;
        if (t + 16 <= len) {
          dot16(query(p, j), keys, dim, a.scale, row + t);
          continue;
        }
        int64_t u = t;
        for (; u + 4 <= len; u += 4) {
          float four[4];
          dot4(query(p, j), keys + (u - t), dim, four);
          for (int i = 0; i < 4; ++i) row[u + i] = four[i] * a.scale;
        }
        for (; u < len; ++u) row[u] = dot(query(p, j), keys[u - t], dim) * a.scale;
      }
    }
  }
  s.inv_sum.resize(width);
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t j = 0; j < group; ++j) {
      s.inv_sum[p * group + j] =
          softmax_unnormalized(s.scores.data() + (p * group + j) * longest, lens[p]);
    }
  }
  s.acc.assign(width * dim, 0.f);
  for (int64_t t0 = 0; t0 < longest; t0 += kValueBlock) {
    for (int64_t i = t0 + kValueBlock; i < std::min(t0 + 2 * kValueBlock, longest); ++i) {
      prefetch_row(v_rows(i), dim);
    }
    for (int64_t p = 0; p < n; ++p) {
      const int64_t end = std::min(t0 + kValueBlock, lens[p]);
      if (end <= t0) continue;
      for (int64_t j = 0; j < group; j += most) {
        const int h = static_cast<int>(std::min<int64_t>(most, group - j));
        value_sums_for<T, DV, most>(h, s.scores.data() + (p * group + j) * longest,
                                           longest, t0, end, v_rows,
                                           s.acc.data() + (p * group + j) * dim);
      }
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t j = 0; j < group; ++j) {
      float* dst = a.out + a.tokens[item.first + p] * a.out_stride + (kv * group + j) * dim;
      const float* sums = s.acc.data() + (p * group + j) * dim;
      const Vec inv(s.inv_sum[p * group + j]);
      for (int d = 0; d < DV; ++d) (Vec::loadu(sums + d * Vec::size()) * inv).store(dst + d * Vec::size());
    }
  }
}

// Every run's work items, over the threads.
template <typename T>
void decode_runs(const DecodeArgs<T>& a, const std::vector<Run>& runs, int64_t kv_heads,
                 int64_t dim) {
  const std::vector<RunItem> items = run_items(runs, kv_heads);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    RunScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      if (dim == 4 * Vec::size()) {
        run_heads<T, 4>(a, items[i], scratch);
      } else {
        run_heads<T, 8>(a, items[i], scratch);
      }
    }
  });
}

}  // namespace shoal_decode

#endif  // CPU_CAPABILITY_AVX512
