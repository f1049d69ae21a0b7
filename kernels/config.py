"""The model shape the forward needs, resolved once from a Hugging Face config.json.

ModelConfig is frozen and narrow: only what a Llama-family decoder (Llama, Mistral, SmolLM2,
Qwen2-style q/k/v biases) needs to run. Everything else in config.json is ignored, and anything
that would change the math without this config saying so (another activation, MLP biases, a
model type we do not implement) is rejected with a ValueError rather than silently run wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
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

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a config.json dict (model_type llama, mistral or qwen2).

        The caller merges generation_config.json's eos_token_id in beforehand (see loader).
        Both the transformers 4 spelling (rope_theta, rope_scaling) and the transformers 5 one
        (rope_parameters) are understood.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act {hidden_act!r} is not supported (only silu)")
        if d.get("mlp_bias", False):
            raise ValueError("config.json mlp_bias=true is not supported")

        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        rope_theta, rope_scaling = _rope(d)

        max_positions = int(d.get("max_position_embeddings", 2048))
        # We implement full attention only. A model whose attention really is windowed
        # (Mistral v0.1) is exact only within the window, so the window caps the context.
        window = d.get("sliding_window")
        if window and (model_type == "mistral" or d.get("use_sliding_window", False)):
            max_positions = min(max_positions, int(window))

        if model_type != "qwen2" and d.get("attention_bias", False):
            # Llama's attention_bias also biases o_proj, which the forward does not implement.
            raise ValueError(f"config.json attention_bias=true is not supported for {model_type}")
        attention_bias = model_type == "qwen2"  # q/k/v biases, none on o_proj
        bos = d.get("bos_token_id")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),  # HF default
            attention_bias=attention_bias,
            max_position_embeddings=max_positions,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=token_ids(d.get("eos_token_id")),
        )


def token_ids(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """An HF token-id field (absent, one id or a list) as a tuple of unique ids, order kept."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling of the RoPE settings."""
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    scaling: dict[str, Any] = dict(d.get("rope_scaling") or params)
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling.pop("rope_theta", None)
    kind = scaling.pop("type", None)  # the old key for rope_type
    scaling.setdefault("rope_type", kind)
    if scaling["rope_type"] in (None, "default"):
        return float(theta), None
    return float(theta), scaling
