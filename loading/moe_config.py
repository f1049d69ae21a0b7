"""A mixture-of-experts MLP's shape and routing, as config.json gives it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's `top_k` experts of `num_experts`, weighted by
    the router's softmax (renormalised over the chosen ones when `normalize`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    # Weight the experts' outputs by the float32 routing weights (Mixtral) rather than by the
    # weights cast to the model's dtype (Qwen3-MoE); the same in float32 models.
    float32_weights: bool = False
