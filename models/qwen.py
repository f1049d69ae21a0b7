"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (RMSNorm over each head of q and k, no biases
unless attention_bias). Both slide their upper layers' attention when use_sliding_window."""

from __future__ import annotations

from shoal.loading.traits import Traits
from shoal.models import standard
from shoal.models.family import Family

QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=Traits(sliding="flagged_upper", qkv_bias_always=True),
)

QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=Traits(sliding="flagged_upper", qk_norm=True),
)
