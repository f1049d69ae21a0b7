// The k largest logits of each row, vectorized: the bfloat16 lm_head computes each row's top
// candidates again in float32 (bf16_linear.py), and torch's CPU topk of 8 over SmolLM2's 49152
// logits took 2.6 ms for a 64-row step on the AMD EPYC VM, where a row here is one pass of
// vector compares against the k-th value so far:
//
//   top_rows(logits, k) -> int64 [R, k]    logits [R, V] float32, rows contiguous
//                                          (stride(1) == 1), 1 <= k <= min(V, 64)
//
// each row's indices of its k largest values, largest first, the lower index first among equal
// values (-0.0 and 0.0 equal), a NaN counting as larger than any number: exactly
// torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]. (torch.topk keeps
// the same values but orders equal ones as it meets them.) The best k so far are kept sorted;
// a vector of 16 (AVX2: 8) logits is looked at one by one only where one beats the k-th. A row
// holding a NaN is taken again one logit at a time. Rows are spread over the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTopLanes = Vec::size();
constexpr int64_t kMost = 64;

// The best k (value, index) so far, best first.
struct Best {
  float value[kMost];
  int64_t index[kMost];
  int64_t k, filled = 0;

  explicit Best(int64_t k_) : k(k_) {}

  // whether (a, ia) goes before (b, ib): larger first, a NaN before any number, the lower index
  // first among equals (and among NaNs)
  static bool before(float a, int64_t ia, float b, int64_t ib) {
    const bool nan_a = std::isnan(a), nan_b = std::isnan(b);
    if (nan_a || nan_b) return nan_a && (!nan_b || ia < ib);
    return a > b || (a == b && ia < ib);
  }

  void offer(float v, int64_t i) {
    int64_t p;
    if (filled < k) {
      p = filled++;
    } else if (before(v, i, value[k - 1], index[k - 1])) {
      p = k - 1;
    } else {
      return;
    }
    for (; p > 0 && before(v, i, value[p - 1], index[p - 1]); --p) {
      value[p] = value[p - 1];
      index[p] = index[p - 1];
    }
    value[p] = v;
    index[p] = i;
  }
};

void row_top(const float* row, int64_t n, int64_t k, int64_t* out) {
  Best best(k);
  int64_t i = 0;
  for (; i < k; ++i) best.offer(row[i], i);
  bool nan = false;
  for (int64_t j = 0; j < k; ++j) nan = nan || std::isnan(best.value[j]);
  // Scanned in index order, a logit equal to the k-th so far comes after it: only a larger one
  // can enter. A NaN compares false, so it is looked for apart.
  for (; !nan && i + kTopLanes <= n; i += kTopLanes) {
    const Vec v = Vec::loadu(row + i);
    if ((v != v).zero_mask() != (1 << kTopLanes) - 1) {
      nan = true;
      break;
    }
    const int not_above = (v > Vec(best.value[k - 1])).zero_mask();
    int above = ~not_above & ((1 << kTopLanes) - 1);
    while (above != 0) {
      const int lane = __builtin_ctz(static_cast<unsigned>(above));
      best.offer(row[i + lane], i + lane);
      above &= above - 1;
    }
  }
  if (nan) {  // again from the start, one logit at a time, NaNs first
    best.filled = 0;
    for (int64_t j = 0; j < n; ++j) best.offer(row[j], j);
  } else {
    for (; i < n; ++i) best.offer(row[i], i);
  }
  for (int64_t j = 0; j < k; ++j) out[j] = best.index[j];
}

at::Tensor top_rows(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "top_rows: logits must be a 2-d float32 CPU tensor with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(k >= 1 && k <= n && k <= kMost, "top_rows: k must be 1 .. min(V, ", kMost, ")");
  at::Tensor out = at::empty({rows, k}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_top(data + r * stride, n, k, index + r * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("top_rows(Tensor logits, int k) -> Tensor", &top_rows);
}
