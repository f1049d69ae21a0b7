// The element-wise work of a CPU decoder layer, one op each instead of five or six small ones
// (a decode step calls them 90 times, where each torch op costs a dispatch and an allocation):
//
//   rms_norm(x, w, eps, out)                out = x * rsqrt(mean(x^2) + eps) * w        [T, C]
//   add_rms_norm(h, delta, w, eps, out)     h += delta; out = rms_norm(h)  (h in place)
//   rope(x, cos, sin)                       x = x * cos + rotate_half(x) * sin in place  [T, H, D]
//   silu_mul(gate_up, out)                  out = silu(gate) * up, gate_up = [gate | up]  [T, 2I]
//
// Float32 only, but silu_mul also takes a bfloat16 gate_up and out (both bfloat16: a bfloat16
// matmul's product in, the next one's input out; computed in float32, rounded once). RoPE is
// bit-equal to Hugging Face's formula (separate multiplies and an add, no fused multiply-add:
// the build passes -ffp-contract=off); RMSNorm sums the squares in another order than torch,
// so it may differ in the last bit. silu_mul is torch's own formula on ATen's vector type
// (x / (1 + exp(-x)), the same exp), so bit-equal too. tests/test_cpu_kernels.py checks them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "ops.h"
#include "silu.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRowsPerTask = 16;  // small batches stay on one thread: no wake-up cost

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, " must be a 2-d float32 CPU tensor with contiguous rows");
}

void norm_row(const float* x, const float* weight, float eps, int64_t cols, float* out) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= cols; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < cols; ++i) sum += x[i] * x[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
  const Vec vscale(scale);
  i = 0;
  for (; i + Vec::size() <= cols; i += Vec::size()) {
    (Vec::loadu(x + i) * vscale * Vec::loadu(weight + i)).store(out + i);
  }
  for (; i < cols; ++i) out[i] = x[i] * scale * weight[i];
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1) && out.sizes() == x.sizes(),
              "rms_norm: weight [C] and out [T, C] must match x [T, C]");
}

}  // namespace

namespace shoal_ops {

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  check_norm(x, weight, out);
  const int64_t cols = x.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const float* x_data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x_data + r * x_stride, w, static_cast<float>(eps), cols, out_data + r * out_stride);
    }
  });
}

void add_rms_norm(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, const at::Tensor& out) {
  check_norm(residual, weight, out);
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == residual.sizes(), "add_rms_norm: delta must match residual");
  const int64_t cols = residual.size(1);
  float* h = residual.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t h_stride = residual.stride(0), d_stride = delta.stride(0);
  const int64_t out_stride = out.stride(0);
  at::parallel_for(0, residual.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = h + r * h_stride;
      const float* add = d + r * d_stride;
      int64_t i = 0;
      for (; i + Vec::size() <= cols; i += Vec::size()) {
        (Vec::loadu(row + i) + Vec::loadu(add + i)).store(row + i);
      }
      for (; i < cols; ++i) row[i] += add[i];
      norm_row(row, w, static_cast<float>(eps), cols, out_data + r * out_stride);
    }
  });
}

void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope: x must be float32 [T, H, D] with dense [H, D] rows");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "rope: head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == tokens && t->size(1) == dim,
                "rope: cos and sin must be contiguous float32 [T, D]");
  }
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = data + t * row_stride + h * dim;
        int64_t i = 0;
        // first half: x1 * cos1 - x2 * sin1 ; second half: x2 * cos2 + x1 * sin2
        for (; i + Vec::size() <= half; i += Vec::size()) {
          const Vec x1 = Vec::loadu(v + i), x2 = Vec::loadu(v + half + i);
          const Vec lo = x1 * Vec::loadu(ct + i) + x2.neg() * Vec::loadu(st + i);
          const Vec hi = x2 * Vec::loadu(ct + half + i) + x1 * Vec::loadu(st + half + i);
          lo.store(v + i);
          hi.store(v + half + i);
        }
        for (; i < half; ++i) {
          const float x1 = v[i], x2 = v[half + i];
          v[i] = x1 * ct[i] + (-x2) * st[i];
          v[half + i] = x2 * ct[half + i] + x1 * st[half + i];
        }
      }
    }
  });
}

// silu_mul of a bfloat16 matmul's product into the next one's bfloat16 input: each row widened
// to float32 (exactly), the float32 formula on the same vectors, rounded to nearest even once,
// so the bits of widening, the float32 op and rounding its result as three steps.
void silu_mul_bf16(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t inter = out.size(1);
  const at::BFloat16* gu = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* out_data = out.data_ptr<at::BFloat16>();
  const int64_t gu_stride = gate_up.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, out.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(inter);
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gate = gu + r * gu_stride;
      const at::BFloat16* up = gate + inter;
      int64_t i = 0;
      for (; i + Vec::size() <= inter; i += Vec::size()) {
        Vec g, u;
        at::vec::load_fp32_from_bf16(gate + i, g);
        at::vec::load_fp32_from_bf16(up + i, u);
        shoal_silu::silu_mul(g, u).store(row.data() + i);
      }
      for (; i < inter; ++i) {
        row[i] = shoal_silu::silu_mul(static_cast<float>(gate[i]), static_cast<float>(up[i]));
      }
      at::vec::convert(row.data(), out_data + r * out_stride, inter);  // to nearest even
    }
  });
}

void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16;
  if (bf16) {
    TORCH_CHECK(gate_up.device().is_cpu() && out.device().is_cpu() && gate_up.dim() == 2 &&
                    out.dim() == 2 && gate_up.stride(1) == 1 && out.stride(1) == 1,
                "silu_mul: gate_up and out must be 2-d CPU tensors with contiguous rows");
  } else {
    check_rows(gate_up, "gate_up");
    check_rows(out, "out");
  }
  const int64_t inter = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && gate_up.size(0) == out.size(0),
              "silu_mul: gate_up must be [T, 2I] for out [T, I]");
  if (bf16) return silu_mul_bf16(gate_up, out);
  const float* gu = gate_up.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t gu_stride = gate_up.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, out.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gu + r * gu_stride;
      const float* up = gate + inter;
      float* row = out_data + r * out_stride;
      int64_t i = 0;
      for (; i + Vec::size() <= inter; i += Vec::size()) {
        shoal_silu::silu_mul(Vec::loadu(gate + i), Vec::loadu(up + i)).store(row + i);
      }
      for (; i < inter; ++i) row[i] = shoal_silu::silu_mul(gate[i], up[i]);
    }
  });
}

}  // namespace shoal_ops

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", &shoal_ops::rms_norm);
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps, Tensor(b!) out) "
      "-> ()",
      &shoal_ops::add_rms_norm);
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &shoal_ops::rope);
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()", &shoal_ops::silu_mul);
}
