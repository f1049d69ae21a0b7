// A float32 linear over weights packed once in panels of 16 output channels (panels.h):
//
//   f32_linear(x, panels, bias, out)    x [M, K] float32, rows contiguous
//                                       panels [ceil(N / 16), K, 16] float32, contiguous
//                                       (linear.py's `pack_panels`)
//                                       bias [N] float32 or None
//                                       out [M, N] float32, rows contiguous
//
//   f32_silu_mul(x, panels, out)        silu(x gate.T) * (x up.T) of a SiLU-gated MLP's fused
//                                       gate_up, out [M, I]; panels [ceil(I / 8), K, 16] hold
//                                       8 gate channels and then their 8 up channels
//                                       (linear.py's `pack_gated_panels`): the product and the
//                                       activation in one pass, bit for bit f32_linear then
//                                       silu_mul (elementwise.cpp)
//
// It is what `PackedLinear` runs at every row count when the kernels are loaded (linear.py),
// and `Int8Linear` from quant.MANY_ROWS rows on: measured here (2-core AVX2 EPYC) it was
// faster than oneDNN's packed matmul from one row to 512.

#include <torch/library.h>

#include "ops.h"
#include "panels.h"
#include "tiles.h"

namespace shoal_ops {

namespace {

// The checked product of x [M, K] and panels of `width` output channels each (16, or 8 gated
// pairs) into out [M, N]: panels [ceil(N / width), K, 16].
shoal_panels::Product checked_product(const char* op, const at::Tensor& x,
                                      const at::Tensor& panels,
                                      const std::optional<at::Tensor>& bias, const at::Tensor& out,
                                      bool gated) {
  const int64_t width = gated ? shoal_panels::kGatedWidth : shoal_panels::kWidth;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, op, ": x and out must be 2-d");
  const int64_t n = out.size(1), k_len = x.size(1);
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat &&
                  panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(2) == shoal_panels::kWidth && panels.size(1) == k_len &&
                  panels.size(0) == (n + width - 1) / width,
              op, ": panels must be a contiguous float32 [ceil(N / ", width,
              "), K, 16] for x [M, K] and out [M, N]");
  shoal_tiles::check_rows(op, x, n, k_len, bias, out);
  shoal_panels::Product product{x.data_ptr<float>(),
                                x.stride(0),
                                x.size(0),
                                panels.data_ptr<float>(),
                                k_len,
                                n,
                                bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                out.data_ptr<float>(),
                                out.stride(0)};
  product.gated = gated;
  return product;
}

}  // namespace

void f32_linear(const at::Tensor& x, const at::Tensor& panels,
                const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  checked_product("f32_linear", x, panels, bias, out, false).run();
}

void f32_silu_mul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& out) {
  checked_product("f32_silu_mul", x, panels, std::nullopt, out, true).run();
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()",
        &shoal_ops::f32_linear);
  m.def("f32_silu_mul(Tensor x, Tensor panels, Tensor(a!) out) -> ()", &shoal_ops::f32_silu_mul);
}
