// The CPU kernels as C++ functions, for the ops that chain them (decoder_layers.cpp). Each is
// also a torch op of the same name and arguments (`torch.ops.shoal_cpu.*`); the comments at
// the top of its source say what it computes and what it checks.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace shoal_ops {

// elementwise.cpp
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out);
void add_rms_norm(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, const at::Tensor& out);
void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out);

// paged_decode.cpp
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_ids, const at::Tensor& seq_lens,
                  const at::Tensor& token_index, int64_t page_size, double scale,
                  const at::Tensor& out, int64_t window, double softcap, bool tiles = true);
void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v);

// paged_extend.cpp
void paged_extend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_ids, const at::Tensor& seq_lens,
                  const at::Tensor& num_new, const at::Tensor& token_start, int64_t page_size,
                  double scale, const at::Tensor& out);

// linear.cpp
void f32_linear(const at::Tensor& x, const at::Tensor& panels,
                const std::optional<at::Tensor>& bias, const at::Tensor& out);
void f32_silu_mul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& out);

// block_linear.cpp
void q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const std::optional<at::Tensor>& bias, const at::Tensor& out);
void q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
               const at::Tensor& m, const std::optional<at::Tensor>& bias, const at::Tensor& out);

// bf16_panels.cpp
bool bf16_panels_supported();
void bf16_panel_linear(const at::Tensor& x, const at::Tensor& panels,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out);
void bf16_silu_mul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& out);

}  // namespace shoal_ops
