"""The tensor names most Hugging Face decoders share (Llama's), and what the config adds to them.

    model.embed_tokens.weight  model.norm.weight  lm_head.weight (absent when tied)
    model.layers.{i}.input_layernorm.weight  .post_attention_layernorm.weight
        .pre_feedforward_layernorm.weight  .post_feedforward_layernorm.weight   (Gemma)
        .self_attn.{q,k,v,o}_proj.weight   (+ .bias: q/k/v when attention_bias, o when o_bias)
        .self_attn.{q,k}_norm.weight       (q/k norm)
        .mlp.{gate,up,down}_proj.weight    (a dense MLP; a family with experts names its own)

A family passes its own MLP naming (`Mlp`) where it differs; Phi-3 (fused projections) has its
own file entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.loading.config import ModelConfig
from shoal.models.layout import (
    DenseMLP,
    ExpertMLP,
    LayerNorms,
    LayerSource,
    LinearWeights,
    ModelSource,
    fused,
)

Shapes = dict[str, tuple[int, ...]]


class Mlp(Protocol):
    """One family's MLP naming: the shapes of layer i's MLP tensors and their layout."""

    def shapes(self, config: ModelConfig, prefix: str, layer: int) -> Shapes: ...

    def source(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int
    ) -> DenseMLP | ExpertMLP: ...


@dataclass(frozen=True)
class GatedMlp:
    """mlp.{gate,up,down}_proj: the dense gated MLP (names configurable for Mixtral's w1/w3/w2)."""

    base: str = "mlp."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def shapes(self, config: ModelConfig, prefix: str, layer: int) -> Shapes:
        hidden, inter = config.hidden_size, config.intermediate_size
        p = prefix + self.base
        return {
            f"{p}{self.gate}.weight": (inter, hidden),
            f"{p}{self.up}.weight": (inter, hidden),
            f"{p}{self.down}.weight": (hidden, inter),
        }

    def source(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int
    ) -> DenseMLP:
        p = prefix + self.base
        gate_up = fused(weights, [f"{p}{self.gate}.weight", f"{p}{self.up}.weight"])
        return DenseMLP(gate_up, weights[f"{p}{self.down}.weight"])


def weight_shapes(config: ModelConfig, mlp: Mlp | None = None) -> Shapes:
    """Every tensor the forward reads, by HF name, with its shape."""
    mlp = mlp or GatedMlp()
    hidden = config.hidden_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: Shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        for name, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{attn}{name}_proj.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{attn}{name}_proj.bias"] = (rows,)
        shapes[attn + "o_proj.weight"] = (hidden, q_dim)
        if config.o_bias:
            shapes[attn + "o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes[attn + "q_norm.weight"] = (config.head_dim,)
            shapes[attn + "k_norm.weight"] = (config.head_dim,)
        shapes.update(mlp.shapes(config, p, i))
        for norm in _norm_names(config):
            shapes[f"{p}{norm}.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def model_source(
    config: ModelConfig, weights: dict[str, torch.Tensor], mlp: Mlp | None = None
) -> ModelSource:
    """The checkpoint in the forward's layout."""
    mlp = mlp or GatedMlp()
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = fused(weights, [f"{attn}{x}_proj.bias" for x in "qkv"])
        qkv: LinearWeights = (fused(weights, [f"{attn}{x}_proj.weight" for x in "qkv"]), qkv_bias)
        o_bias = weights[attn + "o_proj.bias"] if config.o_bias else None
        norm = {name: weights[f"{p}{name}.weight"] for name in _norm_names(config)}
        norms = LayerNorms(
            input=norm["input_layernorm"],
            post_attention=norm["post_attention_layernorm"],
            pre_mlp=norm.get("pre_feedforward_layernorm"),
            post_mlp=norm.get("post_feedforward_layernorm"),
            q=weights[attn + "q_norm.weight"] if config.qk_norm else None,
            k=weights[attn + "k_norm.weight"] if config.qk_norm else None,
        )
        layers.append(
            LayerSource(
                norms,
                qkv,
                (weights[attn + "o_proj.weight"], o_bias),
                mlp.source(config, weights, p, i),
            )
        )
    embed = weights["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
    return ModelSource(embed, weights["model.norm.weight"], lm_head, layers)


def _norm_names(config: ModelConfig) -> tuple[str, ...]:
    names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    if config.sandwich_norms:
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return names
