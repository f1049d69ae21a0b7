// A run of decoder layers for a step whose every token is a decode, chained in C++: the same
// kernels, in the same order, as the Python forward calls one by one (models/
// decoder.py), so the same bits, without the ~20 torch dispatches and Python calls around each
// layer's kernels (3.4 ms of an 11.0 ms one-sequence int8 step on the 2-core VM).
//
//   layers = torch.classes.shoal_cpu.DecoderLayers(tensors, layout, heads, kv_heads, head_dim,
//                                                  eps, scale, many_rows)
//   layers.forward(h, cos, sin, k_caches, v_caches, slots, page_ids, seq_lens, token_index,
//                  page_size, rows) -> h
//
// The layers are the standard ones (Llama, Qwen 2, Mistral without a window): RMSNorm before
// attention and before the MLP, one fused qkv projection (bias optional), RoPE over the whole
// head, paged attention with no window or soft-cap, o, one fused gate_up, SiLU times up, down.
//
//   tensors   per layer: its input norm, its post-attention norm, then the four linears (qkv,
//             o, gate_up, down), each as its parts and then its bias when it has one:
//               kFloat32  the float32 weight in panels (f32_linear, linear.cpp)
//               kQ8       q, d, panels      (q8_linear, block_linear.cpp; from `many_rows`
//                                           rows on f32_linear on the dequantized panels, or
//                                           bf16_linear on them in bfloat16)
//               kQ4       q, d, m, panels   (q4_linear; likewise)
//               kBf16     the bfloat16 weight in oneDNN's layout (bf16_linear.py: oneDNN's
//                         matmul, through the dispatcher as torch.ops.mkldnn calls it)
//   layout    per layer and linear: its kind, its output channels, 1 if it has a bias else 0,
//             then its last part's form (16 a layer): 0 float32 panels, 1 gated panels, 2 a
//             bfloat16 weight in oneDNN's layout (kBf16's, and int8's on a CPU with AMX,
//             quant.py: its many-row steps on the matrix tiles), 3 bfloat16 panels
//             (bf16_panel_linear, bf16_panels.cpp: kBf16's and int8's on a CPU with
//             AVX512-BF16 and no AMX), 4 gated bfloat16 panels. Gated panels (gate_up only,
//             without a bias) hold 8 gate channels and their 8 up channels each, and their
//             product is the activation itself (f32_silu_mul, linear.cpp; bf16_silu_mul,
//             bf16_panels.cpp, in bfloat16, which the down's bfloat16 panels take as it is);
//             an int8 gate_up's blocks stay as they are, for steps of fewer than `many_rows`
//             rows
//
//   h         [T, hidden] float32, the residual stream: updated in place and returned
//   cos, sin  [T, head_dim] the rotation of each token's position
//   k_caches, v_caches   one [slots, Hkv, D] per layer, in order
//   slots, page_ids, seq_lens, token_index, page_size   as store_kv and paged_decode take them;
//             token_index must name every one of the T tokens (a step of decodes only)
//   rows      the rows the step stands for where int8 picks its kernels (`many_rows`): its T
//             tokens less the drafts it verifies (a speculating decode's 1 + k positions are
//             its row's one decode, so they take the kernels that decode takes)
//
// Each kernel checks its arguments as its own op does; a bad step raises, it never reads stray
// memory.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kFloat32 = 0;
constexpr int64_t kQ8 = 1;
constexpr int64_t kQ4 = 2;
constexpr int64_t kBf16 = 3;
// The form of a linear's last part: what it multiplies by at every row count (float32, bf16)
// or from `many_rows` rows on (int8).
constexpr int64_t kPanels = 0;
constexpr int64_t kGatedPanels = 1;
constexpr int64_t kOneDnnBf16 = 2;
constexpr int64_t kBf16Panels = 3;
constexpr int64_t kGatedBf16Panels = 4;
constexpr int64_t kLinearsPerLayer = 4;
constexpr int64_t kLayoutPerLinear = 4;

int64_t parts_of(int64_t kind) {
  TORCH_CHECK(kind == kFloat32 || kind == kQ8 || kind == kQ4 || kind == kBf16,
              "DecoderLayers: unknown kind ", kind);
  return kind == kQ4 ? 4 : kind == kQ8 ? 3 : 1;
}

// x [M, K] times a bfloat16 weight in oneDNN's layout (bf16_linear.py's Bf16Linear): x
// rounded to bfloat16 (or already bfloat16), oneDNN's matmul (AMX where the CPU has it), the
// product in bfloat16.
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x.to(at::kBFloat16), weight, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The same product in float32 and the bias added in float32, as the Python linear computes it.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const at::Tensor product = bf16_product(x, weight);
  return bias.has_value() ? at::add(*bias, product) : product.to(at::kFloat);
}

// Runs f as torch's profiler would see the op `name` (nothing to record when it is off), so
// bench/step_profile.py sorts the chained kernels into its buckets as it does the ops.
template <typename F>
void traced(const char* name, F&& f) {
  RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{});
  f();
}

struct Linear {
  int64_t kind;
  int64_t out_features;
  int64_t last;  // the last part's form: kPanels, kGatedPanels (silu_mul, not operator()),
                 // kOneDnnBf16, kBf16Panels, kGatedBf16Panels (silu_mul too)
  std::vector<at::Tensor> parts;
  std::optional<at::Tensor> bias;

  bool gated() const { return last == kGatedPanels || last == kGatedBf16Panels; }

  // Whether a step multiplies in bfloat16 through oneDNN; `many`: it stands for int8's many
  // rows (DecoderLayers::forward).
  bool bf16_at(bool many) const { return last == kOneDnnBf16 && on_last(many); }

  // Whether a step multiplies by the last part (not by int8 blocks).
  bool on_last(bool many) const { return kind == kFloat32 || kind == kBf16 || many; }

  at::Tensor operator()(const at::Tensor& x, bool many) const {
    const bool panels = on_last(many);
    if (panels && last == kOneDnnBf16) {
      at::Tensor out;
      traced("bf16_linear", [&] { out = bf16_linear(x, parts.back(), bias); });
      return out;
    }
    TORCH_CHECK(!(gated() && panels),
                "DecoderLayers: gated panels give an activation, not a product");
    // float32 out, also for a bfloat16 x (a gated bfloat16 gate_up's activation)
    at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
    if (panels && last == kBf16Panels) {
      traced("bf16_panel_linear",
             [&] { shoal_ops::bf16_panel_linear(x, parts.back(), bias, out); });
    } else if (panels) {
      traced("f32_linear", [&] { shoal_ops::f32_linear(x, parts.back(), bias, out); });
    } else if (kind == kQ8) {
      traced("q8_linear", [&] { shoal_ops::q8_linear(x, parts[0], parts[1], bias, out); });
    } else {
      traced("q4_linear",
             [&] { shoal_ops::q4_linear(x, parts[0], parts[1], parts[2], bias, out); });
    }
    return out;
  }

  // silu(gate) * up of a gate_up: [T, out_features / 2]; in bfloat16 when `bf16_act` (the
  // next linear multiplies in bfloat16 too): the product kept bfloat16 and the activation
  // rounded once, the bits of widening the product and rounding at the next call
  // (kernels/bf16_mlp.py does the same in the Python forward); in bfloat16 too from gated
  // bfloat16 panels (the bits of their plain product, silu_mul and the down's rounding).
  at::Tensor silu_mul(const at::Tensor& x, bool many, bool bf16_act = false) const {
    if (bf16_act && bf16_at(many) && !bias.has_value()) {
      at::Tensor product;
      traced("bf16_linear", [&] { product = bf16_product(x, parts.back()); });
      at::Tensor act = at::empty({x.size(0), out_features / 2}, product.options());
      traced("silu_mul", [&] { shoal_ops::silu_mul(product, act); });
      return act;
    }
    if (last == kGatedBf16Panels && on_last(many)) {
      at::Tensor act = at::empty({x.size(0), out_features / 2}, x.options().dtype(at::kBFloat16));
      traced("bf16_silu_mul", [&] { shoal_ops::bf16_silu_mul(x, parts.back(), act); });
      return act;
    }
    at::Tensor act = at::empty({x.size(0), out_features / 2}, x.options());
    if (gated() && on_last(many)) {
      traced("f32_silu_mul", [&] { shoal_ops::f32_silu_mul(x, parts.back(), act); });
    } else {
      const at::Tensor product = (*this)(x, many);
      traced("silu_mul", [&] { shoal_ops::silu_mul(product, act); });
    }
    return act;
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
};

struct DecoderLayers : torch::CustomClassHolder {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, head_dim, many_rows;
  double eps, scale;

  DecoderLayers(std::vector<at::Tensor> tensors, std::vector<int64_t> layout, int64_t heads,
                int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t many_rows)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), many_rows(many_rows), eps(eps),
        scale(scale) {
    TORCH_CHECK(layout.size() % (kLayoutPerLinear * kLinearsPerLayer) == 0 && !layout.empty(),
                "DecoderLayers: layout must hold 16 entries a layer");
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "DecoderLayers: bad head counts");
    size_t next = 0, entry = 0;  // the next tensor, the next layout entry
    auto take = [&]() {
      TORCH_CHECK(next < tensors.size(), "DecoderLayers: fewer tensors than the layout names");
      return tensors[next++];
    };
    auto linear = [&]() {
      Linear l{layout[entry], layout[entry + 1], layout[entry + 3], {}, std::nullopt};
      TORCH_CHECK(l.last == kPanels || l.last == kGatedPanels || l.last == kOneDnnBf16 ||
                      l.last == kBf16Panels || l.last == kGatedBf16Panels,
                  "DecoderLayers: unknown form ", l.last);
      const bool bf16_last =
          l.last == kOneDnnBf16 || l.last == kBf16Panels || l.last == kGatedBf16Panels;
      TORCH_CHECK((l.kind == kBf16) == bf16_last || l.kind == kQ8 || l.kind == kQ4,
                  "DecoderLayers: a bf16 linear, and only it or an int8 one, ends in a "
                  "bfloat16 weight");
      const bool has_bias = layout[entry + 2] != 0;
      entry += kLayoutPerLinear;
      for (int64_t i = 0; i < parts_of(l.kind); ++i) l.parts.push_back(take());
      if (has_bias) l.bias = take();
      return l;
    };
    while (entry < layout.size()) {
      at::Tensor input_norm = take(), post_attention_norm = take();
      Linear qkv = linear(), o = linear(), gate_up = linear(), down = linear();
      layers.push_back(Layer{input_norm, post_attention_norm, qkv, o, gate_up, down});
    }
    TORCH_CHECK(next == tensors.size(), "DecoderLayers: more tensors than the layout names");
    for (const Layer& l : layers) {
      TORCH_CHECK(l.qkv.out_features == (heads + 2 * kv_heads) * head_dim &&
                      l.gate_up.out_features % 2 == 0,
                  "DecoderLayers: qkv or gate_up has the wrong number of outputs");
      TORCH_CHECK(!l.qkv.gated() && !l.o.gated() && !l.down.gated() &&
                      (!l.gate_up.gated() || !l.gate_up.bias.has_value()),
                  "DecoderLayers: only a gate_up without a bias takes gated panels");
    }
  }

  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     at::Tensor slots, at::Tensor page_ids, at::Tensor seq_lens,
                     at::Tensor token_index, int64_t page_size, int64_t rows) {
    RECORD_FUNCTION("decoder_layers", c10::ArrayRef<const c10::IValue>{});
    const int64_t n = static_cast<int64_t>(layers.size()), tokens = h.size(0);
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n &&
                    static_cast<int64_t>(v_caches.size()) == n,
                "DecoderLayers: one K and one V cache a layer");
    TORCH_CHECK(token_index.dim() == 1 && token_index.size(0) == tokens,
                "DecoderLayers: every token of the step must be a decode");
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    // int8's kernels by the rows the step stands for (a verification's positions are its
    // row's one decode), not by its tokens: each row's bits those of its plain decode
    const bool many = rows >= many_rows;
    at::Tensor x = at::empty_like(h);
    at::Tensor attended = at::empty({tokens, heads, head_dim}, h.options());
    traced("rms_norm", [&] { shoal_ops::rms_norm(h, layers[0].input_norm, eps, x); });
    for (int64_t i = 0; i < n; ++i) {
      const Layer& layer = layers[i];
      const at::Tensor qkv = layer.qkv(x, many);
      const at::Tensor qk = qkv.narrow(1, 0, q_width + kv_width).view({tokens, -1, head_dim});
      traced("rope", [&] { shoal_ops::rope(qk, cos, sin); });
      const at::Tensor q = qk.narrow(1, 0, heads);
      const at::Tensor k = qk.narrow(1, heads, kv_heads);
      const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, -1, head_dim});
      traced("store_kv", [&] { shoal_ops::store_kv(k_caches[i], v_caches[i], slots, k, v); });
      traced("paged_decode", [&] {
        shoal_ops::paged_decode(q, k_caches[i], v_caches[i], page_ids, seq_lens, token_index,
                                page_size, scale, attended, 0, 0.);
      });
      const at::Tensor o = layer.o(attended.view({tokens, q_width}), many);
      traced("add_rms_norm",
             [&] { shoal_ops::add_rms_norm(h, o, layer.post_attention_norm, eps, x); });
      const bool bf16_act = layer.down.bf16_at(many);
      const at::Tensor act = layer.gate_up.silu_mul(x, many, bf16_act);
      const at::Tensor down = layer.down(act, many);
      if (i + 1 < n) {
        traced("add_rms_norm",
               [&] { shoal_ops::add_rms_norm(h, down, layers[i + 1].input_norm, eps, x); });
      } else {
        h.add_(down);
      }
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       double, double, int64_t>())
      .def("forward", &DecoderLayers::forward);
}
