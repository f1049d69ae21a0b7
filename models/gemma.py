"""Gemma 2 and Gemma 3 (text): norms that scale by 1 + w, before and after both attention and
the MLP; the embedding scaled by sqrt(hidden); GeGLU; queries scaled by query_pre_attn_scalar;
sliding-window layers alternating with global ones. Gemma 2 soft-caps attention scores and the
final logits; Gemma 3 normalises q and k per head instead and gives its sliding layers their own
RoPE base."""

from __future__ import annotations

from dataclasses import replace

from shoal.loading.traits import Traits
from shoal.models import standard
from shoal.models.family import Family

# What both Gemmas fix that their config.json does not say.
_GEMMA = Traits(
    activation_field="hidden_activation",
    default_activation="gelu_pytorch_tanh",
    tied_by_default=True,
    norm_plus_one=True,
    sandwich_norms=True,
    embed_scale=True,
    query_pre_attn_scalar=True,
    softcapping=True,
)

GEMMA2 = Family(
    name="gemma2",
    model_types=("gemma2",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=replace(_GEMMA, sliding="even"),
)

GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=replace(_GEMMA, sliding="pattern", qk_norm=True, layer_ropes=True),
)
