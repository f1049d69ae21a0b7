"""A config.json's RoPE settings, in either spelling, checked: (rope_theta, rope_scaling)."""

from __future__ import annotations

from typing import Any

from shoal.kernels.loading.checkpoint import CONFIG_NAME, CheckpointError, json_value
from shoal.kernels.loading.fields import ConfigFields

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_rope(fields: ConfigFields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling of the RoPE settings."""
    params = fields.nested("rope_parameters")
    scaling_name = "rope_scaling" if fields.nested("rope_scaling") else "rope_parameters"
    scaling = dict(fields.nested("rope_scaling") or params)
    if fields.has("rope_theta"):
        theta = fields.positive_number("rope_theta")
    else:
        theta = ConfigFields(params, CONFIG_NAME, "rope_parameters.").positive_number(
            "rope_theta", 10000.0
        )
    scaling.pop("rope_theta", None)
    kind = scaling.pop("type", None)  # the old key for rope_type
    scaling.setdefault("rope_type", kind)
    nested = ConfigFields(scaling, CONFIG_NAME, f"{scaling_name}.")
    kind = nested.values["rope_type"]
    if kind in (None, "default"):
        return theta, None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{CONFIG_NAME}: {scaling_name}.rope_type {json_value(kind)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    nested.positive_number("factor")
    if kind == "llama3":
        low = nested.positive_number("low_freq_factor")
        if nested.positive_number("high_freq_factor") == low:
            raise CheckpointError(
                f"{CONFIG_NAME}: {scaling_name}.high_freq_factor must differ from low_freq_factor"
            )
        nested.positive_number("original_max_position_embeddings")
    return theta, scaling
