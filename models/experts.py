"""Mixture-of-experts families: Mixtral and Qwen3-MoE, Llama's attention (Qwen3's q/k norm for
Qwen3-MoE) over a router and experts (kernels/moe.py) in place of the dense MLP.

    Mixtral    model.layers.{i}.block_sparse_moe.gate.weight                [E, hidden]
               model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight  gate / up / down
    Qwen3-MoE  model.layers.{i}.mlp.gate.weight                            [E, hidden]
               model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
               (layers in mlp_only_layers, or off the decoder_sparse_step, keep the dense MLP)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from shoal.loading.config import ModelConfig
from shoal.loading.traits import ExpertTraits, Traits
from shoal.models import standard
from shoal.models.family import Family
from shoal.models.layout import DenseMLP, ExpertMLP, fused, stacked


@dataclass(frozen=True)
class ExpertNames:
    """One family's names for a sparse layer's router and experts (the dense fallback is
    `dense`'s)."""

    base: str  # "block_sparse_moe." or "mlp."
    gate: str
    up: str
    down: str
    dense: standard.GatedMlp = field(default_factory=standard.GatedMlp)

    def _sparse(self, config: ModelConfig, layer: int) -> bool:
        return config.moe is not None and config.moe.sparse_layers[layer]

    def shapes(self, config: ModelConfig, prefix: str, layer: int) -> standard.Shapes:
        if not self._sparse(config, layer):
            return self.dense.shapes(config, prefix, layer)
        assert config.moe is not None
        hidden, inter = config.hidden_size, config.moe.intermediate_size
        p = prefix + self.base
        shapes: standard.Shapes = {p + "gate.weight": (config.moe.num_experts, hidden)}
        for e in range(config.moe.num_experts):
            shapes[f"{p}experts.{e}.{self.gate}.weight"] = (inter, hidden)
            shapes[f"{p}experts.{e}.{self.up}.weight"] = (inter, hidden)
            shapes[f"{p}experts.{e}.{self.down}.weight"] = (hidden, inter)
        return shapes

    def source(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int
    ) -> DenseMLP | ExpertMLP:
        if not self._sparse(config, layer):
            return self.dense.source(config, weights, prefix, layer)
        assert config.moe is not None
        p = prefix + self.base
        experts = range(config.moe.num_experts)
        gate_up = torch.stack(
            [
                fused(
                    weights,
                    [f"{p}experts.{e}.{self.gate}.weight", f"{p}experts.{e}.{self.up}.weight"],
                )
                for e in experts
            ]
        )
        down = stacked(weights, [f"{p}experts.{e}.{self.down}.weight" for e in experts])
        return ExpertMLP(weights[p + "gate.weight"], gate_up, down)


MIXTRAL_NAMES = ExpertNames("block_sparse_moe.", "w1", "w3", "w2")
QWEN3_MOE_NAMES = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")

MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    weight_shapes=partial(standard.weight_shapes, mlp=MIXTRAL_NAMES),
    source=partial(standard.model_source, mlp=MIXTRAL_NAMES),
    traits=Traits(
        sliding="all",
        experts=ExpertTraits(("num_local_experts",), "intermediate_size", float32_weights=True),
    ),
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    weight_shapes=partial(standard.weight_shapes, mlp=QWEN3_MOE_NAMES),
    source=partial(standard.model_source, mlp=QWEN3_MOE_NAMES),
    traits=Traits(
        sliding="flagged",
        qk_norm=True,
        experts=ExpertTraits(
            # Qwen's own spelling first; transformers 5 writes num_local_experts.
            ("num_experts", "num_local_experts"),
            "moe_intermediate_size",
            sparse_step=True,
            normalize_flag="norm_topk_prob",
        ),
    ),
)
