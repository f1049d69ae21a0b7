// The K and V rows a thread's decode items read (paged_decode.cpp: a whole sequence's [Hkv, D]
// rows, or one KV head's slice of them where there are few sequences), as one stream in the
// order they are read: an item's K rows (the scores' pass), then its V rows (the values' pass),
// then the next item's. The stream is asked for a fixed number of rows ahead of
// where the arithmetic reads, across the two passes and across items, a few rows between each
// head's products rather than a block's worth at once.
//
// Why: a row's keys lie on scattered pages, so the hardware prefetcher cannot see them coming;
// the loops' own prefetches (a block ahead into L1, three into L2) had the scores' pass ask for
// its V rows too, so that pass waited on memory while the values' pass, all in cache, left it
// idle, and a new item started cold. SmolLM2's heads (9 query heads, 3 KV heads of 64), 30
// layers' caches on shuffled pages, 2 threads of a Zen 5 EPYC, alternating builds (`python
// bench/kernels.py --device cpu --impls cpu --batch 16 64 --context 120 250 --layers 30`):
// bfloat16 64 sequences of 250 keys 0.39-0.40 ms a layer against 0.58-0.59, 16 of 120 0.044
// against 0.066-0.070; float32 64 of 250 0.85-0.86 against 0.89-0.90, 16 of 120 0.085 against
// 0.112-0.115; Llama 3 8B's heads (32 query heads, 8 KV heads of 128), 16 sequences of 1000
// bfloat16 keys, 8 layers: 2.68-2.69 against 2.81-2.84. The same rows asked for 16 at once at a
// block's start measured no faster than the loops' prefetches (the spread is what counts); 16
// or 48 rows ahead slower than 24 on SmolLM2's heads, 12 or 6 slower on Llama's (24 of its 2 KB
// rows are L1's 48 KB). Items of one KV head ask for as many bytes ahead (Hkv times the rows):
// one sequence of 4000 bfloat16 keys on SmolLM2's heads 0.102-0.121 ms a layer against
// 0.130-0.145, two 0.221-0.223 against 0.236 (24 of their slices ahead: slower than before).
// The bits are unchanged (prefetches, and the values' pass split into
// blocks of keys, each head's multiply-adds still in key order).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "key_slots.h"

namespace shoal_decode {

// Rows the stream runs ahead of the arithmetic: a sequence's [Hkv, D] rows, or as many bytes of
// one KV head's slices.
constexpr int64_t kStreamAhead = 24;

template <typename T>
class RowStream {
 public:
  // Items first .. end - 1, item i sequence seqs[i / per_seq] (an index into pages and lens)
  // and its `width` elements of each row from ((i % per_seq) * width); slot_stride the elements
  // a slot's [Hkv, D] row holds; window as paged_decode's.
  RowStream(const T* k, const T* v, int64_t slot_stride, int64_t per_seq, int64_t width,
            const int64_t* pages, int64_t max_pages, int64_t page_size, const int64_t* lens,
            int64_t window, const int64_t* seqs, int64_t first, int64_t end)
      : k_(k), v_(v), slot_stride_(slot_stride), per_seq_(per_seq), width_(width),
        pages_(pages), max_pages_(max_pages), page_size_(page_size), lens_(lens),
        window_(window), seqs_(seqs), end_(end) {
    load(first);
    ask(kStreamAhead * slot_stride / width);
  }

  // The next `rows` rows of the stream into L1 (nothing past the thread's last item).
  void ask(int64_t rows) {
    constexpr int64_t per_line = 64 / static_cast<int64_t>(sizeof(T));
    while (rows > 0 && item_ < end_) {
      const int64_t len = static_cast<int64_t>(slots_.size());
      const int64_t n = std::min(rows, len - t_);
      const T* cache = (values_ ? v_ : k_) + (item_ % per_seq_) * width_;
      for (int64_t i = 0; i < n; ++i) {
        const T* row = cache + slots_[t_ + i] * slot_stride_;
        for (int64_t e = 0; e < width_; e += per_line) __builtin_prefetch(row + e, 0, 3);
      }
      t_ += n;
      rows -= n;
      if (t_ < len) continue;
      if (values_) {
        load(item_ + 1);
      } else {
        values_ = true;
        t_ = 0;
      }
    }
  }

 private:
  // The cursor at item `item`'s first K row, and its keys' slots.
  void load(int64_t item) {
    item_ = item;
    values_ = false;
    t_ = 0;
    if (item_ >= end_) return;
    const int64_t b = seqs_[item_ / per_seq_];
    const int64_t first = first_key(lens_[b], window_);
    key_slots(pages_ + b * max_pages_, page_size_, first, lens_[b] - first, slots_);
  }

  const T* k_;
  const T* v_;
  int64_t slot_stride_, per_seq_, width_;
  const int64_t* pages_;
  int64_t max_pages_, page_size_;
  const int64_t* lens_;
  int64_t window_;
  const int64_t* seqs_;
  int64_t end_;
  int64_t item_ = 0;
  bool values_ = false;  // in the item's V rows
  int64_t t_ = 0;        // the next row of the item's pass
  std::vector<int64_t> slots_;
};

}  // namespace shoal_decode
