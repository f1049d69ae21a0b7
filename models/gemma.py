"""Gemma 2 and Gemma 3 (text): norms that scale by 1 + w, before and after both attention and
the MLP; the embedding scaled by sqrt(hidden); GeGLU; queries scaled by query_pre_attn_scalar;
sliding-window layers alternating with global ones. Gemma 2 soft-caps attention scores and the
final logits; Gemma 3 normalises q and k per head instead and gives its sliding layers their own
RoPE base."""

from __future__ import annotations

from shoal.loading.traits import Traits
from shoal.models import standard
from shoal.models.family import Family

GEMMA2 = Family(
    name="gemma2",
    model_types=("gemma2",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=Traits(sliding="even", gemma=True),
)

GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=Traits(sliding="pattern", gemma=True, qk_norm=True, layer_ropes=True),
)
