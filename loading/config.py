"""The model shape the forward needs, resolved once from a Hugging Face config.json.

ModelConfig is frozen and narrow: only what shoal's decoder (models/decoder.py) needs to
run one of the families in models/registry.py. The family's `Traits` (traits.py), which the
caller resolves from `model_type_of(config)` and passes in, say how its config.json is read:
this module knows no family. Everything else in config.json is ignored, and anything that would
change the math without this config saying so (another activation, MLP biases, a model type we
do not implement) is rejected rather than silently run wrong.

Every field the forward uses is checked for its JSON type and range before it is used: sizes
are positive integers (a bool, a float or a string is not one), eps and theta positive finite
numbers, flags true or false, token ids integers below vocab_size. A bad field is a
CheckpointError that names the file and the field, e.g.
"config.json: num_hidden_layers must be a positive integer, got null".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.kernels.rope import rope_context_limit
from shoal.loading.checkpoint import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    CheckpointError,
    json_kind,
    json_value,
    read_json_object,
)
from shoal.loading.fields import ConfigFields
from shoal.loading.layers_config import (
    layer_windows,
    moe_config,
    partial_rotary_dim,
    softcap,
)
from shoal.loading.moe_config import MoEConfig
from shoal.loading.rope_config import read_layer_ropes, read_partial_rotary, read_rope
from shoal.loading.traits import Traits

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
    "o_bias",
    "qk_norm",
    "sandwich_norms",
    "moe",
)
# config.json's activation name -> the gated MLP's activation
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    attention_bias: bool  # q/k/v projections carry biases (Qwen2; Llama's attention_bias)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per layer: its sliding window W (a query at position p sees keys p - W + 1 .. p), or None
    # for full attention.
    layer_windows: tuple[int | None, ...] = ()
    o_bias: bool = False  # o_proj carries a bias (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"  # the gated MLP's: silu or gelu_tanh (Gemma's GeGLU)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma)
    norm_plus_one: bool = False  # norms scale by 1 + w (Gemma): folded into w at load
    embed_scale: float | None = None  # embeddings times this, in the model's dtype (Gemma)
    query_scale: float = 0.0  # attention's q.k scale (head_dim ** -0.5 unless the config says)
    attn_softcap: float | None = None  # attention scores: tanh(s / c) * c (Gemma 2)
    final_softcap: float | None = None  # logits likewise (Gemma 2)
    rotary_dim: int = 0  # the leading dims of each head that RoPE rotates (head_dim: all)
    # The sliding layers' own RoPE where it differs from the full layers' (Gemma 3).
    sliding_rope: tuple[float, dict[str, Any] | None] | None = field(default=None, hash=False)
    moe: MoEConfig | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any sliding layer; None when every layer attends fully."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def kv_window(self) -> int | None:
        """W when every layer slides (the KV before a request's window is never read again),
        else None."""
        windows = self.layer_windows
        if windows and all(w is not None for w in windows):
            return max(w for w in windows if w is not None)
        return None

    def architecture(self) -> dict[str, object]:
        """The fields that decide the weights' names and shapes: a weight update must match
        them (another rope, context or special tokens may come with new weights)."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}

    @classmethod
    def from_hf_config(
        cls, d: dict[str, Any], traits: Traits, generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Read a config.json dict through its family's `traits`, with generation_config.json's
        bos/eos merged in (eos ids are the union).

        Both the transformers 4 spelling (rope_theta, rope_scaling) and the transformers 5 one
        (rope_parameters) are understood. A bad field raises CheckpointError (a ValueError).
        """
        model_type = model_type_of(d)
        fields = ConfigFields(d, CONFIG_NAME)
        activation_field = traits.activation_field
        act_name = fields.text(activation_field, traits.default_activation)
        if act_name not in ACTIVATIONS:
            raise CheckpointError(
                f"{CONFIG_NAME}: {activation_field} {json_value(act_name)} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
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
        rotary_dim = head_dim
        if traits.partial_rotary:
            rotary_dim = partial_rotary_dim(head_dim, read_partial_rotary(fields))
        sliding_rope = None
        if traits.layer_ropes:
            ropes = read_layer_ropes(fields, rotary_dim)
            rope_theta, rope_scaling = ropes["full_attention"]
            sliding_rope = ropes["sliding_attention"]
        else:
            rope_theta, rope_scaling = read_rope(fields, rotary_dim)
        num_layers = fields.positive_int("num_hidden_layers")
        windows = layer_windows(fields, traits, num_layers)
        max_positions = fields.positive_int("max_position_embeddings", 2048)
        # dynamic RoPE is served where it equals the plain one: its original context
        max_positions = rope_context_limit(rope_scaling, max_positions)

        biased = fields.flag("attention_bias", False)
        vocab_size = fields.positive_int("vocab_size")
        generation_fields = ConfigFields(generation or {}, GENERATION_CONFIG_NAME)
        bos, eos = _special_tokens(fields, generation_fields, vocab_size)
        scalar: float = head_dim
        if traits.query_pre_attn_scalar:
            scalar = fields.positive_number("query_pre_attn_scalar", head_dim)
        capped = traits.softcapping
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=fields.flag("tie_word_embeddings", traits.tied_by_default),
            attention_bias=traits.qkv_bias_always or biased,
            max_position_embeddings=max_positions,
            bos_token_id=bos,
            eos_token_ids=eos,
            layer_windows=windows,
            o_bias=biased and not traits.qkv_bias_always,
            qk_norm=traits.qk_norm,
            activation=ACTIVATIONS[act_name],
            sandwich_norms=traits.sandwich_norms,
            norm_plus_one=traits.norm_plus_one,
            embed_scale=hidden_size**0.5 if traits.embed_scale else None,
            query_scale=float(scalar) ** -0.5,
            attn_softcap=softcap(fields, "attn_logit_softcapping") if capped else None,
            final_softcap=softcap(fields, "final_logit_softcapping") if capped else None,
            rotary_dim=rotary_dim,
            sliding_rope=sliding_rope,
            moe=moe_config(fields, traits, num_layers),
        )


def model_type_of(d: object) -> str:
    """config.json's model_type, which names the family that reads the rest (CheckpointError
    when the config is not a JSON object or has no model_type string)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{CONFIG_NAME}: must be a JSON object, got {json_kind(d)}")
    return ConfigFields(d, CONFIG_NAME).text("model_type")


def read_config_files(folder: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The folder's config.json and its generation_config.json, if it has one: JSON objects
    (CheckpointError), read for `ModelConfig.from_hf_config`."""
    config = read_json_object(folder, CONFIG_NAME)
    generation = None
    if (folder / GENERATION_CONFIG_NAME).is_file():
        generation = read_json_object(folder, GENERATION_CONFIG_NAME)
    return config, generation


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
