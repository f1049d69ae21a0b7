"""The Llama-family decoder forward over a paged KV cache (Llama, SmolLM2, Mistral, Qwen2).

`LlamaModel.forward` takes a ragged batch of new tokens, stores their K/V into the pool
and returns logits only for the tokens that sample. The step's attention (prepared by a backend
from the batch) is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels.batch import Attention
from shoal.kernels.config import ModelConfig
from shoal.kernels.rope import apply_rope, cos_sin_table, inv_frequencies


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            out += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up]
            out += [layer.down] + ([layer.qkv_bias] if layer.qkv_bias is not None else [])
        return out


def build_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    def w(name: str) -> torch.Tensor:
        # Always a copy: later loads write into these tensors, never into the caller's.
        return weights[name].to(device=device, dtype=dtype, copy=True)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(attn + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=qkv_bias,
                o=w(attn + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            )
        )
    embed = w("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else w("lm_head.weight")
    return ModelWeights(layers, embed, w("model.norm.weight"), lm_head)


class KVPool:
    """K and V tensors for every layer: [num_slots, num_kv_heads, head_dim] each."""

    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_slots = num_slots


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim**-0.5
        inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        cos, sin = cos_sin_table(inv_freq, config.max_position_embeddings)
        # In the model's dtype, as Hugging Face casts them before rotating.
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        self.load(weights)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a full set of HF-named weights (already checked for names and shapes).

        A later load copies into the tensors of the first, so whatever holds them (a captured
        CUDA graph) reads the new weights.
        """
        built = build_weights(self.config, weights, self.dtype, self.device)
        if not hasattr(self, "weights"):
            self.weights = built
            return
        for old, new in zip(self.weights.tensors(), built.tensors(), strict=True):
            old.copy_(new)

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
        cos = self.cos[positions]
        sin = self.sin[positions]
        weights = self.weights
        h = F.embedding(input_ids, weights.embed)
        for layer_id, layer in enumerate(weights.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            attention.store(kv.k[layer_id], kv.v[layer_id], k, v)
            attn = attention.attend(q, kv.k[layer_id], kv.v[layer_id], self.scale)
            h = h + F.linear(attn.reshape(-1, q_size), layer.o)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        last = rms_norm(h[sample_index], weights.norm, cfg.rms_norm_eps)
        return F.linear(last, weights.lm_head).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face Llama does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
