// Where a decoding sequence's keys lie in the paged KV cache (paged_decode.cpp, its row stream
// and decode_runs.h): the first key it attends under a window, and each key's slot.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shoal_decode {

// Where a sequence of `len` keys starts attending: 0, or the first key of its window (W > 0).
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// slots <- the slot (page * page_size + position % page_size) of keys first .. first + count - 1
// of a row whose pages are row_pages, a page's run at a time (one division a page, not two a
// key).
inline void key_slots(const int64_t* row_pages, int64_t page_size, int64_t first, int64_t count,
                      std::vector<int64_t>& slots) {
  slots.resize(count);
  for (int64_t t = 0, pos = first; t < count;) {
    const int64_t offset = pos % page_size, base = row_pages[pos / page_size] * page_size;
    const int64_t run = std::min(page_size - offset, count - t);
    for (int64_t i = 0; i < run; ++i) slots[t + i] = base + offset + i;
    t += run;
    pos += run;
  }
}

}  // namespace shoal_decode
