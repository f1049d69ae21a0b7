// The argument checks the paged attention kernels share (paged_decode.cpp, paged_extend.cpp):
// q and out, the K/V caches and the page size; each kernel then checks its own index tensors,
// every index before any is read.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace shoal_attention {

//   q, out      [T, H, D] float32 CPU; q's rows may be strided, [H, D] dense; out contiguous
//   k/v_cache   [slots, Hkv, D] contiguous, both float32 or both bfloat16; H a multiple of Hkv
//   page_size   > 0, dividing the slots
inline void check_tensors(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, int64_t page_size, const at::Tensor& out) {
  for (const at::Tensor* t : {&q, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3, op,
                ": q and out must be 3-d float32 CPU tensors");
  }
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == k_cache.scalar_type(),
                op, ": the caches must be 3-d CPU tensors, both float32 or bfloat16");
  }
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == dim,
              op, ": k_cache and v_cache must be contiguous [slots, Hkv, D]");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": H must be a multiple of Hkv");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim, op, ": q rows must be [H, D] dense");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), op, ": out must match q");
  TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0, op, ": bad page_size");
}

}  // namespace shoal_attention
