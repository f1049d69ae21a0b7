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

from dataclasses import dataclass, field
from typing import Any

from shoal.kernels.loading.checkpoint import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    CheckpointError,
    json_kind,
    json_value,
)
from shoal.kernels.loading.fields import ConfigFields
from shoal.kernels.loading.rope_config import read_rope

# The model_types `ModelConfig.from_hf_config` reads (the Llama family, models/llama.py).
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
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
        fields = ConfigFields(d, CONFIG_NAME)
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
        rope_theta, rope_scaling = read_rope(fields)

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
        generation_fields = ConfigFields(generation or {}, GENERATION_CONFIG_NAME)
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


def _special_tokens(
    config: ConfigFields, generation: ConfigFields, vocab_size: int
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
