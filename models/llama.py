"""Llama 2, 3, 3.1 and 3.2 (and SmolLM2): the plain decoder, RoPE with the config's scaling,
tied or untied head, optional attention biases (q, k, v and o)."""

from __future__ import annotations

from shoal.models import standard
from shoal.models.family import Family

LLAMA = Family(
    name="llama",
    model_types=("llama",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
)
