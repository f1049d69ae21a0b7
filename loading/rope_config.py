"""A config.json's RoPE settings, in either spelling, checked and resolved as transformers 5 does.

    read_rope(fields, rotary_dim=None) -> (theta, scaling or None)      one RoPE for all layers
    read_layer_ropes(fields, rotary_dim=None)
        -> {"full_attention": (theta, scaling), "sliding_attention": (theta, scaling)}  (Gemma 3)
    read_partial_rotary(fields) -> the fraction of each head RoPE rotates, in (0, 1]

Spellings (transformers 5 reads both, and so do we, with its precedence):

    transformers 4   rope_theta, rope_scaling {"type" or "rope_type", ...} at the top level;
                     Gemma 3 adds rope_local_base_freq, the sliding layers' theta
    transformers 5   rope_parameters {"rope_type", "rope_theta", ...}; Gemma 3 nests it per
                     layer type: {"full_attention": {...}, "sliding_attention": {...}}

A non-empty rope_scaling replaces rope_parameters; a rope_theta or partial_rotary_factor inside
the chosen dict beats the top-level one. The scaling dict returned is what kernels/rope.py's
rope_tables takes: "rope_type" set ("type" renamed; Phi-3's old "su" and "yarn" are longrope,
as Phi3Config renames them), rope_theta and partial_rotary_factor taken out, and the fields
transformers fills in from elsewhere filled in the same way:

    original_max_position_embeddings (llama3, yarn, longrope): the top-level field when the
        config has one (Phi-3 keeps it there, and transformers lets it win; Phi3Config defaults
        it to 4096), else the dict's, else max_position_embeddings. For per-layer dicts
        transformers skips the top-level field, and so do we.
    factor (longrope, when absent): max_position_embeddings / original_max_position_embeddings,
        from which transformers derives the attention factor.

Every field a type uses is checked for type and range; a bad one is a CheckpointError naming it.
"""

from __future__ import annotations

import math
from typing import Any

from shoal.loading.checkpoint import CONFIG_NAME, CheckpointError, json_value
from shoal.loading.fields import ConfigFields

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
FULL, SLIDING = "full_attention", "sliding_attention"
# model_type -> the (full_attention, sliding_attention) theta when config.json gives none.
_LAYER_DEFAULT_THETAS = {"gemma3": (1_000_000.0, 10_000.0), "gemma3_text": (1_000_000.0, 10_000.0)}
_DEFAULT_THETA = 10_000.0
# model_type -> its config class's default for a top-level original_max_position_embeddings.
_ORIGINAL_MAX_DEFAULTS = {"phi3": 4096}
_PHI3_LONGROPE_ALIASES = ("su", "yarn")

Rope = tuple[float, dict[str, Any] | None]


def read_rope(fields: ConfigFields, rotary_dim: int | None = None) -> Rope:
    """(rope_theta, scaling or None) for a model with one RoPE for every layer. A config whose
    layer types have different ropes (Gemma 3's) is refused: read_layer_ropes reads those.
    With rotary_dim, longrope's factor lists must have rotary_dim // 2 entries."""
    ropes = read_layer_ropes(fields, rotary_dim)
    if ropes[FULL] != ropes[SLIDING]:
        raise CheckpointError(
            f"{CONFIG_NAME}: the RoPE differs by layer type (full_attention, "
            "sliding_attention), which this model does not support"
        )
    return ropes[FULL]


def read_layer_ropes(fields: ConfigFields, rotary_dim: int | None = None) -> dict[str, Rope]:
    """{"full_attention": rope, "sliding_attention": rope}, each (theta, scaling or None).

    Gemma 3: transformers 5 nests rope_parameters per layer type (a missing one is default
    RoPE); transformers 4 gives rope_theta and rope_scaling for the full layers and
    rope_local_base_freq for the sliding ones. Any other config has one RoPE, used for both.
    """
    model_type = _model_type(fields)
    full_theta, sliding_theta = _LAYER_DEFAULT_THETAS.get(
        model_type, (_DEFAULT_THETA, _DEFAULT_THETA)
    )
    params = fields.nested("rope_parameters")
    if FULL in params or SLIDING in params:
        layers = ConfigFields(params, CONFIG_NAME, "rope_parameters.")
        full = dict(layers.nested(FULL)) or {"rope_type": "default"}
        sliding = dict(layers.nested(SLIDING)) or {"rope_type": "default"}
        full.update(fields.nested("rope_scaling"))  # as Gemma3TextConfig does
        full_name, sliding_name = f"rope_parameters.{FULL}", f"rope_parameters.{SLIDING}"
    else:
        full_name, full = _flat_parameters(fields)
        if not fields.has("rope_local_base_freq") and model_type not in _LAYER_DEFAULT_THETAS:
            rope = _resolve(fields, full, full_name, "rope_theta", full_theta, rotary_dim, False)
            return {FULL: rope, SLIDING: rope}
        sliding_name, sliding = "rope_local_base_freq", {"rope_type": "default"}
    # transformers holds these per layer type (Gemma3TextConfig nests even the old spelling)
    return {
        FULL: _resolve(fields, full, full_name, "rope_theta", full_theta, rotary_dim, True),
        SLIDING: _resolve(
            fields, sliding, sliding_name, "rope_local_base_freq", sliding_theta, rotary_dim, True
        ),
    }


def read_partial_rotary(fields: ConfigFields) -> float:
    """partial_rotary_factor: the rope dict's, else the top-level one, else 1.0; in (0, 1]."""
    params = fields.nested("rope_parameters")
    nested = FULL in params or SLIDING in params
    name, values = ("", {}) if nested else _flat_parameters(fields)
    source = fields
    if "partial_rotary_factor" in values:
        source = ConfigFields(values, CONFIG_NAME, f"{name}.")
    factor = source.positive_number("partial_rotary_factor", 1.0)
    if factor > 1.0:
        raise source.error("partial_rotary_factor", "a number in (0, 1]", factor)
    return factor


def _model_type(fields: ConfigFields) -> str:
    model_type = fields.values.get("model_type")
    return model_type if isinstance(model_type, str) else ""


def _flat_parameters(fields: ConfigFields) -> tuple[str, dict[str, Any]]:
    """(its name, the dict) of the one RoPE dict in use: rope_scaling when non-empty."""
    scaling = fields.nested("rope_scaling")
    if scaling:
        return "rope_scaling", scaling
    return "rope_parameters", fields.nested("rope_parameters")


def _resolve(
    fields: ConfigFields,
    values: dict[str, Any],
    name: str,
    theta_field: str,
    default_theta: float,
    rotary_dim: int | None,
    per_layer: bool,
) -> Rope:
    """One RoPE dict checked: (theta, scaling or None), the scaling as rope_tables takes it.
    theta_field is the top-level field that gives theta when the dict does not."""
    scaling = dict(values)
    checked = ConfigFields(scaling, CONFIG_NAME, f"{name}.")
    if checked.has("rope_theta"):
        theta = checked.positive_number("rope_theta")
    else:
        theta = fields.positive_number(theta_field, default_theta)
    partial = scaling.get("partial_rotary_factor", 1.0)
    if per_layer and partial != 1.0:  # read_partial_rotary reads one for the whole model
        raise checked.error("partial_rotary_factor", "1 in a per-layer RoPE", partial)
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    old_kind = scaling.pop("type", None)
    kind = scaling.setdefault("rope_type", old_kind)
    if kind is None:
        kind = scaling["rope_type"] = "default"
    if not isinstance(kind, str):
        raise checked.error("rope_type", "a string", kind)
    if _model_type(fields) == "phi3" and kind in _PHI3_LONGROPE_ALIASES:
        kind = scaling["rope_type"] = "longrope"
    if kind == "default":
        return theta, None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{CONFIG_NAME}: {name}.rope_type {json_value(kind)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind in ("llama3", "yarn", "longrope"):
        scaling["original_max_position_embeddings"] = _original_max(fields, checked, per_layer)
    _check(kind, fields, checked, rotary_dim)
    return theta, scaling


def _original_max(fields: ConfigFields, checked: ConfigFields, per_layer: bool) -> int:
    key = "original_max_position_embeddings"
    if not per_layer:
        if fields.has(key):
            return fields.positive_int(key)
        model_default = _ORIGINAL_MAX_DEFAULTS.get(_model_type(fields))
        if model_default is not None:
            return model_default
    if checked.has(key):
        return checked.positive_int(key)
    return fields.positive_int("max_position_embeddings")


def _check(kind: str, fields: ConfigFields, checked: ConfigFields, rotary_dim: int | None) -> None:
    """The fields `kind` reads, each of the type and range transformers can use."""
    if kind != "longrope":
        checked.positive_number("factor")
    match kind:
        case "dynamic":
            checked.optional_positive_int("original_max_position_embeddings")
        case "llama3":
            low = checked.positive_number("low_freq_factor")
            if checked.positive_number("high_freq_factor") == low:
                raise CheckpointError(
                    f"{CONFIG_NAME}: {checked.prefix}high_freq_factor must differ from "
                    "low_freq_factor"
                )
        case "yarn":
            for key in ("attention_factor", "beta_fast", "beta_slow"):  # null: the default
                if checked.values.get(key) is not None:
                    checked.positive_number(key)
            for key in ("mscale", "mscale_all_dim"):  # 0 or null: unused, as in transformers
                value = checked.values.get(key)
                if value is not None and not (_is_number(value) and 0 <= value < math.inf):
                    raise checked.error(key, "a non-negative number", value)
            checked.flag("truncate", True)
        case "longrope":
            _check_longrope(fields, checked, rotary_dim)


def _check_longrope(fields: ConfigFields, checked: ConfigFields, rotary_dim: int | None) -> None:
    short, long = _factor_list(checked, "short_factor"), _factor_list(checked, "long_factor")
    wanted = len(short) if rotary_dim is None else rotary_dim // 2
    for key, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != wanted:
            raise CheckpointError(
                f"{CONFIG_NAME}: {checked.prefix}{key} has {len(factors)} entries, not {wanted} "
                "(one per rotated pair of each head)"
            )
    if checked.values.get("attention_factor") is not None:
        checked.positive_number("attention_factor")
    if checked.values.get("factor") is not None:
        checked.positive_number("factor")
    elif checked.values.get("attention_factor") is None:
        # transformers derives the attention factor from the ratio of the context lengths
        max_positions = fields.positive_int("max_position_embeddings")
        original = checked.values["original_max_position_embeddings"]
        checked.values["factor"] = max_positions / original


def _factor_list(checked: ConfigFields, key: str) -> list[Any]:
    if not checked.has(key):
        raise CheckpointError(f"{CONFIG_NAME}: {checked.prefix}{key} is missing")
    value = checked.values[key]
    numbers = isinstance(value, list) and value
    if not numbers or not all(_is_number(x) and 0 < x < math.inf for x in value):
        raise checked.error(key, "a non-empty list of positive numbers", value)
    result: list[Any] = value
    return result


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
