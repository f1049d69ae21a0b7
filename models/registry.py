"""Every model family shoal serves, by the model_type of a checkpoint's config.json.

A new family is one file in this folder (its weights' names and shapes, how its config reads)
and a line in FAMILIES (docs/architecture.md, "A model family").
"""

from __future__ import annotations

from shoal.loading.checkpoint import CONFIG_NAME, CheckpointError, json_value
from shoal.models.experts import MIXTRAL, QWEN3_MOE
from shoal.models.family import Family
from shoal.models.gemma import GEMMA2, GEMMA3
from shoal.models.llama import LLAMA
from shoal.models.mistral import MISTRAL
from shoal.models.phi3 import PHI3
from shoal.models.qwen import QWEN2, QWEN3

FAMILIES: tuple[Family, ...] = (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, MIXTRAL, QWEN3_MOE,
)  # fmt: skip


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for family in FAMILIES for t in family.model_types)


def family_of(model_type: object) -> Family:
    """The family serving that model_type; CheckpointError naming the supported ones."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise CheckpointError(
        f"{CONFIG_NAME}: model_type {json_value(model_type)} is not supported; "
        f"supported: {', '.join(supported_model_types())}"
    )
