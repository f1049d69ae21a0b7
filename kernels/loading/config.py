"""The model shape the forward needs, resolved once from a Hugging Face config.json.

ModelConfig is frozen and narrow: only what a Llama-family decoder (Llama, Mistral, SmolLM2,
Qwen2-style q/k/v biases) needs to run. Everything else in config.json is ignored, and anything
that would change the math without this config saying so (another activation, MLP biases, a
model type we do not implement) is rejected rather than silently run wrong.

Every field the forward uses is checked for its JSON type and range before it is used: sizes
are positive integers (a bool, a float or a string is not one), eps and theta positive finite
numbers, flags true or false, token ids integers below vocab_size. A bad field is a
CheckpointError that names the file and the field, e.g.
"config.json: num_hidden_layers must be a positive integer, got null".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shoal.kernels.loading.checkpoint import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    CheckpointError,
    json_kind,
    json_value,
)

# The model_types `ModelConfig.from_hf_config` reads (the Llama family, models/llama.py).
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
)
MAX_SIZE = 2**31 - 1  # the largest size (vocab, hidden, layers, positions, ...) we accept
_REQUIRED = object()  # the default of a field that must be present


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # config.json's: which family (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF rope scaling parameters with the kind under "rope_type" (e.g. {"rope_type": "llama3",
    # "factor": 8.0, ...}), or None for plain RoPE. Not part of the hash: a dict is unhashable.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def architecture(self) -> dict[str, str | int | bool]:
        """The fields that decide the weights' names and shapes: a weight update must match
        them (another rope, context or special tokens may come with new weights)."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}

    @classmethod
    def from_hf_config(
        cls, d: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Read a config.json dict (model_type llama, mistral or qwen2), with
        generation_config.json's bos/eos merged in (eos ids are the union).

        Both the transformers 4 spelling (rope_theta, rope_scaling) and the transformers 5 one
        (rope_parameters) are understood. A bad field raises CheckpointError (a ValueError).
        """
        if not isinstance(d, dict):
            raise CheckpointError(f"{CONFIG_NAME}: must be a JSON object, got {json_kind(d)}")
        fields = _Fields(d, CONFIG_NAME)
        model_type = fields.text("model_type")
        if model_type not in LLAMA_MODEL_TYPES:
            raise CheckpointError(
                f"{CONFIG_NAME}: model_type {json_value(model_type)} is not supported; "
                f"supported: {', '.join(LLAMA_MODEL_TYPES)}"
            )
        hidden_act = fields.text("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(
                f"{CONFIG_NAME}: hidden_act {json_value(hidden_act)} is not supported (only silu)"
            )
        if fields.flag("mlp_bias", False):
            raise CheckpointError(f"{CONFIG_NAME}: mlp_bias=true is not supported")

        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.optional_positive_int("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise CheckpointError(
                f"{CONFIG_NAME}: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = fields.optional_positive_int("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise CheckpointError(
                    f"{CONFIG_NAME}: hidden_size ({hidden_size}) is not a multiple of "
                    f"num_attention_heads ({num_heads}) and head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        if head_dim % 2 != 0:
            raise CheckpointError(f"{CONFIG_NAME}: head_dim ({head_dim}) must be even for RoPE")
        rope_theta, rope_scaling = _rope(fields)

        max_positions = fields.positive_int("max_position_embeddings", 2048)
        # We implement full attention only. A model whose attention really is windowed
        # (Mistral v0.1) is exact only within the window, so the window caps the context.
        window = fields.optional_positive_int("sliding_window")
        if window and (model_type == "mistral" or fields.flag("use_sliding_window", False)):
            max_positions = min(max_positions, window)

        if model_type != "qwen2" and fields.flag("attention_bias", False):
            # Llama's attention_bias also biases o_proj, which the forward does not implement.
            raise CheckpointError(
                f"{CONFIG_NAME}: attention_bias=true is not supported for {model_type}"
            )
        attention_bias = model_type == "qwen2"  # q/k/v biases, none on o_proj
        vocab_size = fields.positive_int("vocab_size")
        generation_fields = _Fields(generation or {}, GENERATION_CONFIG_NAME)
        bos, eos = _special_tokens(fields, generation_fields, vocab_size)
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_layers=fields.positive_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),  # HF default
            attention_bias=attention_bias,
            max_position_embeddings=max_positions,
            bos_token_id=bos,
            eos_token_ids=eos,
        )


class _Fields:
    """Typed reads of one JSON object's fields. An absent field takes its default (or is an
    error without one); null does too where `nullable`, else it is a wrong type."""

    def __init__(self, values: dict[str, Any], file_name: str, prefix: str = "") -> None:
        self.values = values
        self.file_name = file_name
        self.prefix = prefix  # "rope_scaling." for the fields of a nested object

    def has(self, name: str) -> bool:
        return name in self.values

    def positive_int(self, name: str, default: Any = _REQUIRED) -> int:
        value = self._get(name, default, False)
        if not _is_int(value) or not 0 < value <= MAX_SIZE:
            raise self.error(name, "a positive integer", value)
        result: int = value
        return result

    def optional_positive_int(self, name: str) -> int | None:
        """Absent or null reads as None."""
        if self.values.get(name) is None:
            return None
        return self.positive_int(name)

    def positive_number(self, name: str, default: Any = _REQUIRED) -> float:
        value = self._get(name, default, False)
        number = _is_int(value) or isinstance(value, float)
        if not number or not math.isfinite(value) or value <= 0:
            raise self.error(name, "a positive number", value)
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default, False)
        if not isinstance(value, bool):
            raise self.error(name, "true or false", value)
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> str:
        value = self._get(name, default, False)
        if not isinstance(value, str):
            raise self.error(name, "a string", value)
        return value

    def nested(self, name: str) -> dict[str, Any]:
        """A nested object; absent or null reads as {}."""
        value = self._get(name, {}, True)
        if not isinstance(value, dict):
            raise self.error(name, "an object", value)
        return value

    def token_ids(self, name: str, vocab_size: int) -> tuple[int, ...]:
        """A token id or a list of them (absent or null: none), unique, order kept."""
        value = self._get(name, None, True)
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
            wanted = f"a token id or a list of token ids below vocab_size {vocab_size}"
            raise self.error(name, wanted, value)
        return tuple(dict.fromkeys(ids))

    def error(self, name: str, wanted: str, value: object) -> CheckpointError:
        return CheckpointError(
            f"{self.file_name}: {self.prefix}{name} must be {wanted}, got {json_value(value)}"
        )

    def _get(self, name: str, default: Any, nullable: bool) -> Any:
        if name not in self.values:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.file_name}: {self.prefix}{name} is missing")
            return default
        value = self.values[name]
        return default if value is None and nullable and default is not _REQUIRED else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _special_tokens(
    config: _Fields, generation: _Fields, vocab_size: int
) -> tuple[int | None, tuple[int, ...]]:
    """(bos id or None, eos ids): config.json's, then generation_config.json's."""
    bos_ids = config.token_ids("bos_token_id", vocab_size)
    if not bos_ids:
        bos_ids = generation.token_ids("bos_token_id", vocab_size)
    if len(bos_ids) > 1:
        raise CheckpointError(f"{CONFIG_NAME}: bos_token_id must be a single token id")
    eos = config.token_ids("eos_token_id", vocab_size)
    eos += generation.token_ids("eos_token_id", vocab_size)
    return (bos_ids[0] if bos_ids else None), tuple(dict.fromkeys(eos))


def _rope(fields: _Fields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling of the RoPE settings."""
    params = fields.nested("rope_parameters")
    scaling_name = "rope_scaling" if fields.nested("rope_scaling") else "rope_parameters"
    scaling = dict(fields.nested("rope_scaling") or params)
    if fields.has("rope_theta"):
        theta = fields.positive_number("rope_theta")
    else:
        theta = _Fields(params, CONFIG_NAME, "rope_parameters.").positive_number(
            "rope_theta", 10000.0
        )
    scaling.pop("rope_theta", None)
    kind = scaling.pop("type", None)  # the old key for rope_type
    scaling.setdefault("rope_type", kind)
    nested = _Fields(scaling, CONFIG_NAME, f"{scaling_name}.")
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
