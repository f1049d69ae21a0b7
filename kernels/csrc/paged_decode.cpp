// Paged decode attention on the CPU: one new token per sequence attends to every token of its
// row (or of its window), reading K and V in place from the pages (no gather into a padded
// copy). The query heads that share a KV head are done together, so each K and V row is read
// once per step and layer; with two or more sequences a thread, all of a sequence's heads are,
// so each token's [Hkv, D] rows are read whole. In AVX-512 builds a head of whole vectors is
// scored sixteen, then four, keys at a time (dot16, dot4: the horizontal sums share their
// instructions), and a head of 64 or 128 sums the values with a few query heads' sums held in
// registers over all keys (value_sums); all give the bits of the one-key loops. Those heads'
// items ask for their K and V rows as one stream a fixed distance ahead (row_stream.h). A
// speculating row's positions go to decode_runs.h (decode_math.h has the arithmetic both share).
//
//   q, out        [T, H, D]          float32; row i of a sequence is token_index[i]
//   k/v_cache     [slots, Hkv, D]    float32 or bfloat16 (both the same); slot = page *
//                                    page_size + position % page_size. bfloat16 rows are
//                                    widened to float32 as they are read (exactly: float32's
//                                    arithmetic), or with `tiles` on a CPU with AMX-BF16 go
//                                    through tile_attention.cpp (q and the softmax's weights
//                                    rounded to bfloat16)
//   page_ids      [B, P]             int64; a sequence's pages in position order
//   seq_lens      [B]                int64; tokens attended (1 .. P * page_size)
//   token_index   [B]                int64; which of the T rows is the sequence's new token
//   window        W > 0: a sequence of length L attends to its last min(L, W) tokens only,
//                 and positions before L - W are never read (their pages may be reused);
//                 0 or negative: to all of them
//   softcap       c > 0: logits become c * tanh(logits / c) before the softmax; 0: as they are
//
// Built by kernels/cpu_kernels.py with torch's extension loader; tests/kernels/
// test_cpu_kernels.py checks it against the gather-and-SDPA reference in kernels/attention.py,
// tests/kernels/test_kv_bf16.py its bfloat16 paths.
//
//   store_kv(k_cache, v_cache, slots, k, v)    k_cache[slots[i]] = k[i], v_cache likewise
//     k, v   [T, Hkv, D] float32 with dense [Hkv, D] rows (views of the fused qkv output);
//            into a bfloat16 cache rounded to nearest even, as torch's .to(torch.bfloat16)
//     slots  [T] int64, each checked before any write
//
// is what index_copy_ does twice (a step stores 2 x layers times), in one op a layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "attention_args.h"
#include "balanced_split.h"
#include "decode_math.h"
#include "decode_runs.h"
#include "key_slots.h"
#include "ops.h"
#include "row_stream.h"
#include "tile_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace shoal_decode;

// From this many sequences a thread on, a work item is a whole sequence (paged_decode).
constexpr int64_t kSequencesPerThread = 2;
// An item's cost beside its keys' (its queries, softmax and output), in keys, where threads
// share the items out
constexpr int64_t kItemCost = 16;

// logits <- softcap * tanh(logits / softcap), as Gemma 2's eager attention computes them.
inline void soft_cap(float* row, int64_t len, float softcap) {
  const Vec cap(softcap);
  int64_t t = 0;
  for (; t + Vec::size() <= len; t += Vec::size()) {
    ((Vec::loadu(row + t) / cap).tanh() * cap).store(row + t);
  }
  for (; t < len; ++t) row[t] = std::tanh(row[t] / softcap) * softcap;
}

void check_decode_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& page_ids, const at::Tensor& seq_lens,
                       const at::Tensor& token_index, int64_t page_size, int64_t window,
                       const at::Tensor& out) {
  shoal_attention::check_tensors("paged_decode", q, k_cache, v_cache, page_size, out);
  for (const at::Tensor* t : {&page_ids, &seq_lens, &token_index}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_decode: page_ids, seq_lens and token_index must be contiguous int64");
  }
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

// paged_decode over caches of T (float or BFloat16), its arguments checked. `tiles`: a
// bfloat16 cache's two products on AMX (tile_attention.cpp) where the CPU has them, D is whole
// 32s and a KV head has at most 16 query heads.
template <typename T>
void decode_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_ids, const at::Tensor& seq_lens,
                  const at::Tensor& token_index, int64_t page_size, double scale,
                  const at::Tensor& out, int64_t window, double softcap, bool tiles) {
  const int64_t batch = seq_lens.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t max_pages = page_ids.size(1), q_stride = q.stride(0);
  const int64_t slot_stride = kv_heads * dim, out_stride = out.stride(0);
  const float* q_data = q.data_ptr<float>();
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();
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
  constexpr bool bf16 = std::is_same_v<T, BFloat16>;
  const bool on_tiles =
      bf16 && tiles && dim % 32 == 0 && group <= 16 && shoal_tiles::tiles_ready();
  // The sequences the items below take: all, but a speculating row's positions where
  // decode_runs.h takes them (the same bits).
  std::vector<int64_t> seqs;
#if defined(CPU_CAPABILITY_AVX512)
  // Not on the AMX tiles: a bfloat16 cache's products there are tile_attention.cpp's, for one
  // sequence's KV head at a time.
  if (!on_tiles && (dim == 64 || dim == 128) && window <= 0 && fsoftcap == 0.f) {
    const DecodeArgs<T> args{q_data, q_stride, k_data, v_data, slot_stride, out_data, out_stride,
                             pages, max_pages, page_size, lens, tokens, group, fscale};
    const std::vector<Run> runs = find_runs(args, batch);
    if (!runs.empty()) {
      decode_runs(args, runs, kv_heads, dim);
      for (int64_t b = 0, r = 0; b < batch; ++b) {
        if (r < static_cast<int64_t>(runs.size()) && b >= runs[r].first) {
          b = runs[r].first + runs[r].count - 1;
          ++r;
          continue;
        }
        seqs.push_back(b);
      }
      if (seqs.empty()) return;
    }
  }
#endif
  if (seqs.empty()) {
    seqs.resize(batch);
    for (int64_t b = 0; b < batch; ++b) seqs[b] = b;
  }
  const int64_t count = static_cast<int64_t>(seqs.size());
  const int64_t span = count >= kSequencesPerThread * at::get_num_threads() ? kv_heads : 1;
  const int64_t items_per_seq = kv_heads / span, width = span * group;
#if defined(CPU_CAPABILITY_AVX512)
  // Heads of 64 or 128: the items' rows asked for as one stream (row_stream.h)
  const bool streamed = !on_tiles && (dim == 64 || dim == 128);
#else
  const bool streamed = false;
#endif
  // The items shared out by their keys (a sequence of 400 keys beside ones of 30)
  const int64_t items = count * items_per_seq;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const std::vector<int64_t> bounds = shoal_split::balanced_split(items, threads, [&](int64_t i) {
    const int64_t b = seqs[i / items_per_seq];
    return lens[b] - first_key(lens[b], window) + kItemCost;
  });
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    const int64_t begin = bounds[t_begin], end = bounds[t_end];
    std::optional<RowStream<T>> stream;
    if (streamed) {
      stream.emplace(k_data, v_data, slot_stride, items_per_seq, span * dim, pages, max_pages,
                     page_size, lens, window, seqs.data(), begin, end);
    }
    std::vector<float> scores;  // [width, len]: logits, then unnormalized probabilities
    std::vector<float> acc(width * dim);
    std::vector<float> inv_sum(width);
    std::vector<int64_t> slots;  // the item's keys' slots
    std::vector<const T*> rows;  // on the tiles: a KV head's K (then V) row of each key
    shoal_tiles::Scratch scratch;
    if (on_tiles) shoal_tiles::configure(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = seqs[item / items_per_seq], kv0 = (item % items_per_seq) * span;
      // Keys first .. lens[b] - 1, the t-th of them at position first + t.
      const int64_t first = first_key(lens[b], window), len = lens[b] - first;
      const int64_t* row_pages = pages + b * max_pages;
      const float* q_heads = q_data + tokens[b] * q_stride + kv0 * group * dim;
      key_slots(row_pages, page_size, first, len, slots);
      auto row_of = [&](const T* cache, int64_t t) {
        return cache + slots[t] * slot_stride + kv0 * dim;
      };
      scores.resize(width * len);
      // rows <- the KV head's row of each key in `cache`
      auto head_rows = [&](const T* cache, int64_t kv) {
        rows.resize(len);
        for (int64_t t = 0; t < len; ++t) rows[t] = row_of(cache, t) + kv * dim;
      };
      if constexpr (bf16) {
        for (int64_t kv = 0; on_tiles && kv < span; ++kv) {
          head_rows(k_data, kv);
          shoal_tiles::scores(q_heads + kv * group * dim, group, dim, rows.data(), slot_stride,
                              len, fscale, scores.data() + kv * group * len, len, scratch);
        }
      }
      int64_t t = 0;
#if defined(CPU_CAPABILITY_AVX512)
      // sixteen keys, then four, at a time where the head is whole vectors (the same bits as
      // one at a time)
      for (; !on_tiles && dim % Vec::size() == 0 && t + 16 <= len; t += 16) {
        for (int64_t i = 0; !streamed && i < 16 && t + i + kPrefetchAhead16 < len; ++i) {
          prefetch_row(row_of(k_data, t + i + kPrefetchAhead16), span * dim);
          prefetch_row_l2(row_of(v_data, t + i + kPrefetchAhead16), span * dim);
          if (t + i + kPrefetchL2Ahead16 < len) {
            prefetch_row_l2(row_of(k_data, t + i + kPrefetchL2Ahead16), span * dim);
          }
        }
        const T* keys[16];
        for (int i = 0; i < 16; ++i) keys[i] = row_of(k_data, t + i);
        for (int64_t kv = 0, j = 0; kv < span; ++kv) {
          const T* heads_keys[16];
          for (int i = 0; i < 16; ++i) heads_keys[i] = keys[i] + kv * dim;
          for (int64_t end_j = j + group; j < end_j; ++j) {
            if (streamed) stream->ask((j + 1) * 16 / width - j * 16 / width);  // 16 a block
            dot16(q_heads + j * dim, heads_keys, dim, fscale, scores.data() + j * len + t);
          }
        }
      }
      for (; !on_tiles && dim % Vec::size() == 0 && t + 4 <= len; t += 4) {
        if (streamed) stream->ask(4);
        for (int64_t i = 0; !streamed && i < 4 && t + i + kPrefetchAhead < len; ++i) {
          prefetch_row(row_of(k_data, t + i + kPrefetchAhead), span * dim);
          prefetch_row_l2(row_of(v_data, t + i + kPrefetchAhead), span * dim);
        }
        const T* keys[4] = {row_of(k_data, t), row_of(k_data, t + 1), row_of(k_data, t + 2),
                            row_of(k_data, t + 3)};
        for (int64_t kv = 0, j = 0; kv < span; ++kv) {
          const T* heads_keys[4] = {keys[0] + kv * dim, keys[1] + kv * dim, keys[2] + kv * dim,
                                    keys[3] + kv * dim};
          for (int64_t end_j = j + group; j < end_j; ++j) {
            float four[4];
            dot4(q_heads + j * dim, heads_keys, dim, four);
            for (int i = 0; i < 4; ++i) scores[j * len + t + i] = four[i] * fscale;
          }
        }
      }
#endif
      for (; !on_tiles && t < len; ++t) {
        if (streamed) stream->ask(1);
        if (!streamed && t + kPrefetchAhead < len) {
          prefetch_row(row_of(k_data, t + kPrefetchAhead), span * dim);
        }
        const T* keys = row_of(k_data, t);
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
      if constexpr (bf16) {
        if (on_tiles) {
          for (int64_t kv = 0; kv < span; ++kv) {
            head_rows(v_data, kv);
            float* heads_out[16];
            for (int64_t n = 0; n < group; ++n) {
              heads_out[n] = out_data + tokens[b] * out_stride + ((kv0 + kv) * group + n) * dim;
            }
            shoal_tiles::values(scores.data() + kv * group * len, len, group, len, rows.data(),
                                dim, inv_sum.data() + kv * group, heads_out, scratch);
          }
          continue;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      bool summed = false;
#if defined(CPU_CAPABILITY_AVX512)
      // A head of 64 or 128 (streamed: not on the tiles): a few heads of one KV head at a time
      // with their sums in registers, over blocks of 16 keys (each head's multiply-adds still in
      // key order: the same bits), the stream asked for a KV head's share of a block at a time
      if (dim == 4 * Vec::size() || dim == 8 * Vec::size()) {
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          const int64_t t1 = std::min(len, t0 + 16), n = t1 - t0;
          for (int64_t kv = 0; kv < span; ++kv) {
            stream->ask((kv + 1) * n / span - kv * n / span);
            const ValueRows<T> row{v_data + (kv0 + kv) * dim, slots.data(), slot_stride};
            const int64_t most = dim == 4 * Vec::size() ? kValueHeads4 : kValueHeads8;
            for (int64_t j = kv * group; j < (kv + 1) * group; j += most) {
              const int h = static_cast<int>(std::min(most, (kv + 1) * group - j));
              const float* first = scores.data() + j * len;
              float* sums = acc.data() + j * dim;
              if (dim == 4 * Vec::size()) {
                value_sums_for<T, 4, kValueHeads4>(h, first, len, t0, t1, row, sums);
              } else {
                value_sums_for<T, 8, kValueHeads8>(h, first, len, t0, t1, row, sums);
              }
            }
          }
        }
        summed = true;
      }
#endif
      for (int64_t t = 0; t < len && !summed; ++t) {
        if (t + kPrefetchAhead < len) prefetch_row(row_of(v_data, t + kPrefetchAhead), span * dim);
        const T* values = row_of(v_data, t);
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
    if (on_tiles) shoal_tiles::release();
  });
}

// The rows of T tokens into their slots: float32 copied, bfloat16 rounded to nearest even.
template <typename T>
void store_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slot,
                int64_t tokens, const at::Tensor& k, const at::Tensor& v) {
  const int64_t row = k_cache.size(1) * k_cache.size(2);
  T* k_dst = k_cache.data_ptr<T>();
  T* v_dst = v_cache.data_ptr<T>();
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  for (int64_t i = 0; i < tokens; ++i) {
    std::copy_n(k_src + i * k_stride, row, k_dst + slot[i] * row);  // float -> T: T's rounding
    std::copy_n(v_src + i * v_stride, row, v_dst + slot[i] * row);
  }
}

}  // namespace

namespace shoal_ops {

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_ids, const at::Tensor& seq_lens,
                  const at::Tensor& token_index, int64_t page_size, double scale,
                  const at::Tensor& out, int64_t window, double softcap, bool tiles) {
  check_decode_args(q, k_cache, v_cache, page_ids, seq_lens, token_index, page_size, window, out);
  if (k_cache.scalar_type() == at::kBFloat16) {
    decode_pages<BFloat16>(q, k_cache, v_cache, page_ids, seq_lens, token_index, page_size,
                           scale, out, window, softcap, tiles);
  } else {
    decode_pages<float>(q, k_cache, v_cache, page_ids, seq_lens, token_index, page_size, scale,
                        out, window, softcap, false);
  }
}

void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v) {
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.device().is_cpu() && (bf16 || k_cache.scalar_type() == at::kFloat) &&
                  k_cache.dim() == 3 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: k_cache and v_cache must be contiguous [slots, Hkv, D], both float32 or "
              "bfloat16");
  const int64_t num_slots = k_cache.size(0);
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
  if (bf16) {
    store_rows<BFloat16>(k_cache, v_cache, slot, tokens, k, v);
  } else {
    store_rows<float>(k_cache, v_cache, slot, tokens, k, v);
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
      "float softcap=0., bool tiles=True) -> ()",
      &shoal_ops::paged_decode);
}
