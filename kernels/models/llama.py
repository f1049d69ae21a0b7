"""The Llama family (model_type llama, mistral, qwen2: Llama 2/3, SmolLM2, Mistral, Qwen2):
its checkpoint's tensors by Hugging Face name, and its decoder forward over a paged KV cache.

`LlamaModel.forward` takes a ragged batch of new tokens, stores their K/V into the pool
and returns logits only for the tokens that sample. The step's attention (prepared by a backend
from the batch) is an argument. Registered in registry.py as LLAMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels.batch import Attention
from shoal.kernels.elementwise import Elementwise, TorchElementwise
from shoal.kernels.linear import Linear, LinearKind, make_linear
from shoal.kernels.loading.config import LLAMA_MODEL_TYPES, ModelConfig
from shoal.kernels.models.family import Family
from shoal.kernels.models.kv_pool import KVPool
from shoal.kernels.rope import cos_sin_table, inv_frequencies


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(H + 2 Hkv) D, hidden] (+ bias)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 I, hidden]
    down: Linear


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: Linear  # built from the embedding when tied

    def tensors(self) -> list[torch.Tensor]:
        """The plain tensors (norms, embedding), in a fixed order."""
        out = [self.embed, self.norm]
        for layer in self.layers:
            out += [layer.input_norm, layer.post_norm]
        return out

    def linears(self) -> list[Linear]:
        out = [self.lm_head]
        for layer in self.layers:
            out += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return out


LinearWeights = tuple[torch.Tensor, torch.Tensor | None]


def linear_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> list[LinearWeights]:
    """Each projection's weight (and bias), fused as the forward multiplies them, in the order
    of `ModelWeights.linears`. Tensors as given (HF names, any dtype and device)."""
    lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out: list[LinearWeights] = [(weights[lm_head], None)]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([weights[attn + f"{x}_proj.bias"] for x in "qkv"])
        out += [
            (torch.cat([weights[attn + f"{x}_proj.weight"] for x in "qkv"]), qkv_bias),
            (weights[attn + "o_proj.weight"], None),
            (torch.cat([weights[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]), None),
            (weights[p + "mlp.down_proj.weight"], None),
        ]
    return out


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, by HF name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def plain_tensors(config: ModelConfig, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The norms and the embedding, in the order of `ModelWeights.tensors`."""
    out = [weights["model.embed_tokens.weight"], weights["model.norm.weight"]]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out += [weights[p + f"{x}_layernorm.weight"] for x in ("input", "post_attention")]
    return out


def build_weights(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    kind: LinearKind,
) -> ModelWeights:
    def own(t: torch.Tensor) -> torch.Tensor:
        # Always a copy: later loads write into these tensors, never into the caller's.
        return t.to(device=device, dtype=dtype, copy=True)

    embed, norm, *norms = [own(t) for t in plain_tensors(config, weights)]
    linears = []
    for weight, bias in linear_weights(config, weights):
        if kind == "dense" and weight is weights["model.embed_tokens.weight"]:
            linears.append(make_linear(kind, embed, None))  # tied: the embedding itself
            continue
        linears.append(make_linear(kind, own(weight), None if bias is None else own(bias)))
    lm_head, *per_layer = linears
    layers = [
        LayerWeights(
            input_norm=norms[2 * i],
            qkv=per_layer[4 * i],
            o=per_layer[4 * i + 1],
            post_norm=norms[2 * i + 1],
            gate_up=per_layer[4 * i + 2],
            down=per_layer[4 * i + 3],
        )
        for i in range(config.num_layers)
    ]
    return ModelWeights(layers, embed, norm, lm_head)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        linear_kind: LinearKind = "dense",
        elementwise: Elementwise | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.linear_kind = linear_kind
        self.elementwise = elementwise or TorchElementwise()
        self.scale = config.head_dim**-0.5
        inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        cos, sin = cos_sin_table(inv_freq, config.max_position_embeddings)
        # In the model's dtype, as Hugging Face casts them before rotating.
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        self.load(weights)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a full set of HF-named weights (already checked for names and shapes).

        A later load copies into the tensors of the first (and each linear takes its new weight
        as its kind does, see linear.py), so whatever holds them (a captured CUDA graph) reads
        the new weights.
        """
        if not hasattr(self, "weights"):
            self.weights = build_weights(
                self.config, weights, self.dtype, self.device, self.linear_kind
            )
            return
        own = self.weights
        for old, new in zip(own.tensors(), plain_tensors(self.config, weights), strict=True):
            old.copy_(new)
        fresh = linear_weights(self.config, weights)
        for linear, (weight, bias) in zip(own.linears(), fresh, strict=True):
            # Copies: a packed linear keeps the tensor it is given, never the caller's.
            cast = weight.to(device=self.device, dtype=self.dtype, copy=True)
            own_bias = None if bias is None else bias.to(self.device, self.dtype, copy=True)
            linear.load(cast, own_bias)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        kv: KVPool,
        sample_index: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; sample_index: [S] rows of T that sample. Returns [S, V]."""
        cfg = self.config
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        cos = self.cos[positions]
        sin = self.sin[positions]
        weights = self.weights
        ops = self.elementwise
        eps = cfg.rms_norm_eps
        layers = weights.layers
        h = F.embedding(input_ids, weights.embed)
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for layer_id, layer in enumerate(layers):
            qkv = layer.qkv(x)
            # q and k rotate together: [T, H + Hkv, D] in one pass.
            qk = ops.rope(qkv[:, : q_size + kv_size].view(-1, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            attention.store(kv.k[layer_id], kv.v[layer_id], k, v)
            attn = attention.attend(q, kv.k[layer_id], kv.v[layer_id], self.scale)
            h, x = ops.add_rms_norm(h, layer.o(attn.reshape(-1, q_size)), layer.post_norm, eps)
            mlp = layer.down(ops.silu_mul(layer.gate_up(x)))
            if layer_id + 1 < len(layers):  # the residual add, fused with the next layer's norm
                h, x = ops.add_rms_norm(h, mlp, layers[layer_id + 1].input_norm, eps)
            else:
                h = h + mlp
        last = ops.rms_norm(h[sample_index], weights.norm, eps)
        return weights.lm_head(last).float()


LLAMA = Family(
    name="llama",
    model_types=LLAMA_MODEL_TYPES,
    weight_shapes=weight_shapes,
    model=LlamaModel,
)
