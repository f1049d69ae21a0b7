"""What every GGUF architecture shoal converts states the same way, read once and checked:
sizes, heads, context, RoPE base, norm epsilon, tied embeddings and special token ids, as the
transformers config kwargs they become (GGUFCommon.kwargs). gguf_config.py adds each
architecture's own fields.
"""

from __future__ import annotations

from typing import Any

from shoal.loading.checkpoint import CheckpointError
from shoal.loading.gguf_metadata import GGUFMetadata
from shoal.loading.gguf_rope import rope_parameters

ConfigKwargs = dict[str, Any]

_ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")


class GGUFCommon:
    """What every supported architecture states the same way, read once and checked."""

    def __init__(self, meta: GGUFMetadata) -> None:
        self.hidden_size = required_int(meta, "embedding_length")
        num_heads = meta.layer_int("attention.head_count")
        if num_heads is None:
            raise CheckpointError(f"GGUF metadata {meta.arch}.attention.head_count is missing")
        self.num_heads: int = num_heads
        self.num_layers = required_int(meta, "block_count")
        default_head_dim = self.hidden_size // self.num_heads
        self.head_dim = int(meta.arch_value("attention.key_length", default_head_dim))
        value_length = int(meta.arch_value("attention.value_length", self.head_dim))
        if value_length != self.head_dim:
            raise CheckpointError(
                f"GGUF key_length {self.head_dim} != value_length {value_length}, which no "
                "supported HF model has"
            )
        self.rotary_dims = int(meta.arch_value("rope.dimension_count", self.head_dim))
        self.max_positions = int(meta.arch_value("context_length", 2048))
        self.rope_theta = float(meta.arch_value("rope.freq_base", 10000.0))
        self.kwargs: ConfigKwargs = {
            "vocab_size": meta.tensor_rows("token_embd.weight"),  # what the weights hold
            "hidden_size": self.hidden_size,
            "intermediate_size": meta.layer_int("feed_forward_length"),
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": meta.layer_int("attention.head_count_kv", self.num_heads),
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": float(meta.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            "tie_word_embeddings": not meta.has_tensor("output.weight"),
            **special_tokens(meta),
            "dtype": "float32",  # every tensor is written dequantized to float32
        }

    def rope(self, meta: GGUFMetadata, *, partial: bool = False) -> dict[str, Any]:
        """rope_parameters; rotating only part of the head is an error unless `partial`."""
        if self.rotary_dims != self.head_dim and not partial:
            raise CheckpointError(
                f"GGUF rope.dimension_count {self.rotary_dims} != head dim {self.head_dim}, "
                f"which {meta.arch} does not support"
            )
        return rope_parameters(
            meta, self.rope_theta, rotary_dims=self.rotary_dims, max_positions=self.max_positions
        )


def attention_biases(meta: GGUFMetadata) -> bool:
    """Whether the attention projections carry biases (layer 0 speaks for all)."""
    return any(meta.has_tensor(f"blk.0.{part}.bias") for part in _ATTENTION_PARTS)


def special_tokens(meta: GGUFMetadata) -> ConfigKwargs:
    """bos / eos / pad ids; eos is every end-of-generation id the file names (eos, eot, eom)."""
    eos = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := meta.value(f"tokenizer.ggml.{key}")) is not None
    ]
    eos = list(dict.fromkeys(eos))
    bos = meta.value("tokenizer.ggml.bos_token_id")
    pad = meta.value("tokenizer.ggml.padding_token_id")
    return {
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": None if pad is None else int(pad),
    }


def required_int(meta: GGUFMetadata, key: str) -> int:
    value = meta.arch_value(key)
    if value is None:
        raise CheckpointError(f"GGUF metadata {meta.arch}.{key} is missing")
    return int(value)
