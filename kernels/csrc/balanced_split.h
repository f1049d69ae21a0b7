// Items shared out to threads as contiguous ranges of about equal cost, where a plain
// parallel_for gives each thread as many items whatever their cost (a step's decodes: sequences
// of 30 keys beside ones of 400). Each item's arithmetic is its own, so the split moves no bit.
//
//   const std::vector<int64_t> bounds = balanced_split(items, threads, cost);
//   at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
//     for (int64_t item = bounds[t0]; item < bounds[t1]; ++item) ...
//   });
//
// bounds[t] .. bounds[t + 1] - 1 are thread t's items (bounds[0] = 0, bounds[threads] = items):
// the first item whose cost before it reaches t / threads of the whole. A parallel_for that
// runs inline (nested in another) takes 0 .. threads at once, so every item still runs once.

#pragma once

#include <cstdint>
#include <vector>

namespace shoal_split {

template <typename Cost>
std::vector<int64_t> balanced_split(int64_t items, int64_t threads, Cost&& cost) {
  std::vector<int64_t> before(items + 1, 0);  // the cost of items 0 .. i - 1
  for (int64_t i = 0; i < items; ++i) before[i + 1] = before[i] + cost(i);
  std::vector<int64_t> bounds(threads + 1, items);
  bounds[0] = 0;
  for (int64_t t = 1, i = 0; t < threads; ++t) {
    const int64_t share = before[items] * t / threads;
    while (i < items && before[i] < share) ++i;
    bounds[t] = i;
  }
  return bounds;
}

}  // namespace shoal_split
