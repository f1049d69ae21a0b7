"""The parts of config.json that vary by layer or by family rule, read through a family's
`Traits` (traits.py): each layer's sliding window, the experts of a mixture-of-experts model,
the RoPE's rotated share of a head and soft-capping values."""

from __future__ import annotations

from shoal.kernels.rope import partial_rotary_dim as rope_partial_dim
from shoal.loading.checkpoint import CONFIG_NAME, CheckpointError
from shoal.loading.fields import ConfigFields
from shoal.loading.moe_config import MoEConfig
from shoal.loading.traits import Traits

LAYER_TYPES = ("full_attention", "sliding_attention")


def partial_rotary_dim(head_dim: int, factor: float) -> int:
    """The dims RoPE rotates, as transformers rounds them; CheckpointError if none or odd."""
    try:
        return rope_partial_dim(head_dim, factor)
    except ValueError as exc:
        raise CheckpointError(f"{CONFIG_NAME}: partial_rotary_factor: {exc}") from None


def softcap(fields: ConfigFields, name: str) -> float | None:
    """A soft-capping value: absent or null is none."""
    if fields.values.get(name) is None:
        return None
    return fields.positive_number(name)


def layer_windows(fields: ConfigFields, traits: Traits, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), from layer_types where the config
    has them, else by the family's rule."""
    window = fields.optional_positive_int("sliding_window")
    types = fields.values.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != num_layers
            or any(t not in LAYER_TYPES for t in types)
        ):
            wanted = f"a list of {num_layers} of {', '.join(LAYER_TYPES)}"
            raise fields.error("layer_types", wanted, types)
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = [_slides(fields, traits, i) for i in range(num_layers)]
    if any(sliding) and window is None:
        if traits.sliding in ("all", "none") and types is None:
            return (None,) * num_layers
        raise CheckpointError(f"{CONFIG_NAME}: sliding layers need sliding_window")
    return tuple(window if s else None for s in sliding)


def _slides(fields: ConfigFields, traits: Traits, layer: int) -> bool:
    rule = traits.sliding
    if rule == "all":
        return True
    if rule in ("flagged_upper", "flagged"):
        if not fields.flag("use_sliding_window", False):
            return False
        return rule == "flagged" or layer >= fields.positive_int("max_window_layers", 28)
    if rule == "even":
        return layer % 2 == 0
    if rule == "pattern":
        pattern = fields.positive_int("sliding_window_pattern", 6)
        return (layer + 1) % pattern != 0
    return False


def moe_config(fields: ConfigFields, traits: Traits, num_layers: int) -> MoEConfig | None:
    rule = traits.experts
    if rule is None:
        return None
    name = next((n for n in rule.count_fields if fields.has(n)), rule.count_fields[-1])
    num_experts = fields.positive_int(name)
    sparse = (True,) * num_layers
    if rule.sparse_step:
        step = fields.positive_int("decoder_sparse_step", 1)
        dense = fields.values.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise fields.error("mlp_only_layers", "a list of layer indices", dense)
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    normalize = rule.normalize_flag is None or fields.flag(rule.normalize_flag, False)
    size = fields.positive_int(rule.size_field)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise CheckpointError(
            f"{CONFIG_NAME}: num_experts_per_tok ({top_k}) exceeds the number of experts "
            f"({num_experts})"
        )
    return MoEConfig(num_experts, top_k, size, normalize, sparse, rule.float32_weights)
