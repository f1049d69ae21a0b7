"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's decoder with q, k and v in one projection
(`qkv_proj`) and gate and up in another (`gate_up_proj`, gate rows first), sliding-window
attention in every layer when the config sets `sliding_window`, and its own RoPE scaling
(longrope) and partial rotary factor, read by rope_config.py."""

from __future__ import annotations

import torch

from shoal.loading.config import ModelConfig
from shoal.loading.traits import Traits
from shoal.models.family import Family
from shoal.models.layout import DenseMLP, LayerNorms, LayerSource, ModelSource

_NORMS = ("input_layernorm", "post_attention_layernorm")


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.qkv_proj.weight"] = (qkv_rows, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, config.num_heads * config.head_dim)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        for norm in _NORMS:
            shapes[f"{p}{norm}.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def model_source(config: ModelConfig, weights: dict[str, torch.Tensor]) -> ModelSource:
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        norms = LayerNorms(*(weights[f"{p}{norm}.weight"] for norm in _NORMS))
        mlp = DenseMLP(weights[p + "mlp.gate_up_proj.weight"], weights[p + "mlp.down_proj.weight"])
        qkv = (weights[p + "self_attn.qkv_proj.weight"], None)
        layers.append(LayerSource(norms, qkv, (weights[p + "self_attn.o_proj.weight"], None), mlp))
    embed = weights["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
    return ModelSource(embed, weights["model.norm.weight"], lm_head, layers)


PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    weight_shapes=weight_shapes,
    source=model_source,
    traits=Traits(sliding="all", partial_rotary=True),
)
