// Paged decode attention on the CPU: one new token per sequence attends to every token of its
// row (or of its window), reading K and V in place from the pages (no gather into a padded
// copy). The query heads that share a KV head are done together, so each K and V row is read
// once per step and layer; with two or more sequences a thread, all of a sequence's heads are,
// so each token's [Hkv, D] rows are read whole.
//
//   q, out        [T, H, D]          float32; row i of a sequence is token_index[i]
//   k/v_cache     [slots, Hkv, D]    float32; slot = page * page_size + position % page_size
//   page_ids      [B, P]             int64; a sequence's pages in position order
//   seq_lens      [B]                int64; tokens attended (1 .. P * page_size)
//   token_index   [B]                int64; which of the T rows is the sequence's new token
//   window        W > 0: a sequence of length L attends to its last min(L, W) tokens only,
//                 and positions before L - W are never read (their pages may be reused);
//                 0 or negative: to all of them
//   softcap       c > 0: logits become c * tanh(logits / c) before the softmax; 0: as they are
//
// Built by kernels/cpu_kernels.py with torch's extension loader; tests/test_cpu_kernels.py
// checks it against the gather-and-SDPA reference in kernels/attention.py.
//
//   store_kv(k_cache, v_cache, slots, k, v)    k_cache[slots[i]] = k[i], v_cache likewise
//     k, v   [T, Hkv, D] float32 with dense [Hkv, D] rows (views of the fused qkv output)
//     slots  [T] int64, each checked before any write
//
// is what index_copy_ does twice (a step stores 2 x layers times), in one op a layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// a . b over `dim` floats: whole vectors in lanes, the rest (a head_dim that is not a multiple
// of the vector width) one by one.
inline float dot(const float* a, const float* b, int64_t dim) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= dim; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < dim; ++i) sum += a[i] * b[i];
  return sum;
}

// acc += weight * x over `dim` floats.
inline void add_scaled(float weight, const float* x, float* acc, int64_t dim) {
  const Vec w(weight);
  int64_t i = 0;
  for (; i + Vec::size() <= dim; i += Vec::size()) {
    at::vec::fmadd(w, Vec::loadu(x + i), Vec::loadu(acc + i)).store(acc + i);
  }
  for (; i < dim; ++i) acc[i] += weight * x[i];
}

// row <- exp(row - max(row)); returns 1 / sum(row). The exp is ATen's exp_u20, as torch's own
// CPU flash attention uses.
inline float softmax_unnormalized(float* row, int64_t len) {
  const float peak = *std::max_element(row, row + len);
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

// Rows are scattered over pages, so the hardware prefetcher cannot see the next one coming:
// each loop asks for the row this many keys ahead (cold pages measured 2x slower without it).
constexpr int64_t kPrefetchAhead = 8;
constexpr int64_t kFloatsPerLine = 16;
// From this many sequences a thread on, a work item is a whole sequence (paged_decode).
constexpr int64_t kSequencesPerThread = 2;

inline void prefetch_row(const float* row, int64_t dim) {
  for (int64_t i = 0; i < dim; i += kFloatsPerLine) __builtin_prefetch(row + i, 0, 3);
}

// Where sequence `len` starts attending: 0, or the first key of its window.
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// logits <- softcap * tanh(logits / softcap), as Gemma 2's eager attention computes them.
inline void soft_cap(float* row, int64_t len, float softcap) {
  const Vec cap(softcap);
  int64_t t = 0;
  for (; t + Vec::size() <= len; t += Vec::size()) {
    ((Vec::loadu(row + t) / cap).tanh() * cap).store(row + t);
  }
  for (; t < len; ++t) row[t] = std::tanh(row[t] / softcap) * softcap;
}

void check_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& page_ids, const at::Tensor& seq_lens,
                const at::Tensor& token_index, int64_t page_size, int64_t window,
                const at::Tensor& out) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3,
                "paged_decode: q, caches and out must be 3-d float32 CPU tensors");
  }
  for (const at::Tensor* t : {&page_ids, &seq_lens, &token_index}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_decode: page_ids, seq_lens and token_index must be contiguous int64");
  }
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == dim,
              "paged_decode: k_cache and v_cache must be contiguous [slots, Hkv, D]");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode: H must be a multiple of Hkv");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim, "paged_decode: q rows must be [H, D] dense");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "paged_decode: out must match q");
  TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0, "paged_decode: bad page_size");
  TORCH_CHECK(page_ids.dim() == 2 && seq_lens.dim() == 1 && token_index.dim() == 1 &&
                  page_ids.size(0) == seq_lens.size(0) && token_index.size(0) == seq_lens.size(0),
              "paged_decode: page_ids [B, P], seq_lens [B] and token_index [B] disagree");
  // Every index is checked before any is read: a bad batch is an error, never a stray read.
  const int64_t num_pages = k_cache.size(0) / page_size, max_pages = page_ids.size(1);
  const int64_t* pages = page_ids.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tokens = token_index.data_ptr<int64_t>();
  for (int64_t b = 0; b < seq_lens.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * page_size,
                "paged_decode: sequence length out of range");
    TORCH_CHECK(tokens[b] >= 0 && tokens[b] < q.size(0), "paged_decode: token index out of range");
    const int64_t used = (lens[b] + page_size - 1) / page_size;
    for (int64_t p = first_key(lens[b], window) / page_size; p < used; ++p) {
      const int64_t page = pages[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "paged_decode: page id out of range");
    }
  }
}

}  // namespace

namespace shoal_ops {

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_ids, const at::Tensor& seq_lens,
                  const at::Tensor& token_index, int64_t page_size, double scale,
                  const at::Tensor& out, int64_t window, double softcap) {
  check_args(q, k_cache, v_cache, page_ids, seq_lens, token_index, page_size, window, out);
  const int64_t batch = seq_lens.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t max_pages = page_ids.size(1), q_stride = q.stride(0);
  const int64_t slot_stride = kv_heads * dim, out_stride = out.stride(0);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k_cache.data_ptr<float>();
  const float* v_data = v_cache.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t* pages = page_ids.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tokens = token_index.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);

  // One work item: the query heads of one sequence that share KV heads kv0 .. kv0 + span - 1.
  // With enough sequences to share out, a whole sequence (span = Hkv): each token's K and V
  // rows are then read whole, [Hkv, D] contiguous, instead of one head's slice at a time.
  // With fewer, one KV head (span = 1), so that every thread gets work. The arithmetic of each
  // head is the same either way.
  const int64_t span = batch >= kSequencesPerThread * at::get_num_threads() ? kv_heads : 1;
  const int64_t items_per_seq = kv_heads / span, width = span * group;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [width, len]: logits, then unnormalized probabilities
    std::vector<float> acc(width * dim);
    std::vector<float> inv_sum(width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, kv0 = (item % items_per_seq) * span;
      // Keys first .. lens[b] - 1, the t-th of them at position first + t.
      const int64_t first = first_key(lens[b], window), len = lens[b] - first;
      const int64_t* row_pages = pages + b * max_pages;
      const float* q_heads = q_data + tokens[b] * q_stride + kv0 * group * dim;
      auto row_of = [&](const float* cache, int64_t t) {
        const int64_t pos = first + t;
        const int64_t slot = row_pages[pos / page_size] * page_size + pos % page_size;
        return cache + slot * slot_stride + kv0 * dim;
      };
      scores.resize(width * len);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len) prefetch_row(row_of(k_data, t + kPrefetchAhead), span * dim);
        const float* keys = row_of(k_data, t);
        for (int64_t kv = 0, j = 0; kv < span; ++kv) {
          for (int64_t end_j = j + group; j < end_j; ++j) {
            scores[j * len + t] = dot(q_heads + j * dim, keys + kv * dim, dim) * fscale;
          }
        }
      }
      if (fsoftcap > 0.f) {  // a KV head's group at a time, as the vector lanes always fell
        for (int64_t kv = 0; kv < span; ++kv) {
          soft_cap(scores.data() + kv * group * len, group * len, fsoftcap);
        }
      }
      for (int64_t j = 0; j < width; ++j) {
        inv_sum[j] = softmax_unnormalized(scores.data() + j * len, len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len) prefetch_row(row_of(v_data, t + kPrefetchAhead), span * dim);
        const float* values = row_of(v_data, t);
        for (int64_t kv = 0, j = 0; kv < span; ++kv) {
          for (int64_t end_j = j + group; j < end_j; ++j) {
            add_scaled(scores[j * len + t], values + kv * dim, acc.data() + j * dim, dim);
          }
        }
      }
      for (int64_t j = 0; j < width; ++j) {
        float* dst = out_data + tokens[b] * out_stride + (kv0 * group + j) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = acc[j * dim + d] * inv_sum[j];
      }
    }
  });
}

void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 3 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == at::kFloat,
              "store_kv: k_cache and v_cache must be contiguous float32 [slots, Hkv, D]");
  const int64_t row = k_cache.size(1) * k_cache.size(2), num_slots = k_cache.size(0);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous() && slots.dim() == 1,
              "store_kv: slots must be contiguous int64 [T]");
  const int64_t tokens = slots.size(0);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == tokens &&
                    t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(2) &&
                    t->stride(2) == 1 && t->stride(1) == k_cache.size(2),
                "store_kv: k and v must be float32 [T, Hkv, D] with dense [Hkv, D] rows");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "store_kv: slot out of range");
  }
  float* k_dst = k_cache.data_ptr<float>();
  float* v_dst = v_cache.data_ptr<float>();
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  for (int64_t i = 0; i < tokens; ++i) {
    std::copy_n(k_src + i * k_stride, row, k_dst + slot[i] * row);
    std::copy_n(v_src + i * v_stride, row, v_dst + slot[i] * row);
  }
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def(
      "store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()",
      &shoal_ops::store_kv);
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_ids, Tensor seq_lens, "
      "Tensor token_index, int page_size, float scale, Tensor(a!) out, int window=0, "
      "float softcap=0.) -> ()",
      &shoal_ops::paged_decode);
}
