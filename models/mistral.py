"""Mistral: Llama's layout with sliding-window attention in every layer when the config sets
`sliding_window` (v0.1: 4096; later versions set none and attend fully)."""

from __future__ import annotations

from shoal.loading.traits import Traits
from shoal.models import standard
from shoal.models.family import Family

MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    weight_shapes=standard.weight_shapes,
    source=standard.model_source,
    traits=Traits(sliding="all"),
)
