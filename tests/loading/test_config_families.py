"""How each family's config.json reads (loading/config.py through the family's Traits):
which layers slide when the config has no layer_types (transformers 4 era configs), which layers
carry experts, what the family fixes (biases, q/k norm, Gemma's scaling), and the refusals."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from shoal.loading.config import ModelConfig
from shoal.loading.traits import Traits
from shoal.models.load import model_config


def config(model_type: str, layers: int = 6, **overrides: Any) -> ModelConfig:
    d: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    d.update(overrides)
    return model_config(d)


def slides(c: ModelConfig) -> list[bool]:
    return [w is not None for w in c.layer_windows]


def test_which_layers_slide_without_layer_types() -> None:
    assert slides(config("mistral", sliding_window=64)) == [True] * 6
    assert config("mistral", sliding_window=None).kv_window is None
    assert slides(config("gemma2", sliding_window=64)) == [True, False] * 3  # even layers
    gemma3 = config("gemma3_text", sliding_window=64, sliding_window_pattern=3)
    assert slides(gemma3) == [True, True, False, True, True, False]
    assert gemma3.sliding_window == 64 and gemma3.kv_window is None
    qwen = config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=4)
    assert slides(qwen) == [False] * 4 + [True] * 2
    assert slides(config("qwen2", use_sliding_window=False, sliding_window=64)) == [False] * 6
    assert config("phi3", sliding_window=64).kv_window == 64


def test_layer_types_win_and_are_checked() -> None:
    types = ["full_attention", "sliding_attention"] * 3
    c = config("qwen3", sliding_window=32, layer_types=types)
    assert slides(c) == [False, True] * 3
    with pytest.raises(ValueError, match="layer_types must be a list of 6"):
        config("qwen3", sliding_window=32, layer_types=types[:5])
    with pytest.raises(ValueError, match="sliding layers need sliding_window"):
        config("qwen3", layer_types=types)


def test_experts_by_family() -> None:
    mixtral = config("mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert mixtral.moe is not None and mixtral.moe.sparse_layers == (True,) * 6
    assert mixtral.moe.normalize and mixtral.moe.float32_weights
    assert mixtral.moe.intermediate_size == 512
    qwen = config(
        "qwen3_moe",
        num_experts=8,  # Qwen's own spelling; transformers 5 writes num_local_experts
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    assert qwen.moe is not None and qwen.moe.sparse_layers == (
        False, True, False, False, False, True,
    )  # fmt: skip
    assert not qwen.moe.normalize and qwen.moe.intermediate_size == 64
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        config("mixtral", num_local_experts=2, num_experts_per_tok=3)


def test_what_each_family_fixes() -> None:
    assert config("qwen2").attention_bias and not config("qwen2").o_bias
    llama = config("llama", attention_bias=True)
    assert llama.attention_bias and llama.o_bias  # Llama's flag biases o_proj too
    assert config("qwen3").qk_norm and not config("llama").qk_norm
    gemma = config(
        "gemma2",
        head_dim=32,
        query_pre_attn_scalar=144,
        attn_logit_softcapping=50.0,
        sliding_window=4096,
    )
    assert gemma.norm_plus_one and gemma.sandwich_norms and gemma.activation == "gelu_tanh"
    assert gemma.embed_scale == 256**0.5 and gemma.query_scale == 144**-0.5
    assert gemma.attn_softcap == 50.0 and gemma.final_softcap is None
    assert gemma.tie_word_embeddings  # Gemma's default
    with pytest.raises(ValueError, match="hidden_activation"):
        config("gemma2", hidden_activation="relu", sliding_window=4096)
    with pytest.raises(ValueError, match="sliding layers need sliding_window"):
        config("gemma2")  # its sliding layers must say how far they see


def test_rope_by_family() -> None:
    dynamic = config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                            "original_max_position_embeddings": 1024})  # fmt: skip
    assert dynamic.max_position_embeddings == 1024  # served where it is the plain RoPE
    phi = config("phi3", partial_rotary_factor=0.5)
    assert phi.rotary_dim == phi.head_dim // 2
    assert config("llama", partial_rotary_factor=0.5).rotary_dim == 64  # Llama rotates it all
    gemma3 = config("gemma3_text", sliding_window=64, rope_theta=1e6, rope_local_base_freq=1e4)
    assert gemma3.rope_theta == 1e6 and gemma3.sliding_rope == (1e4, None)


# Each of the facts Gemma fixes, alone: the Traits field, its value, and the ModelConfig fields
# it changes (of a config.json that carries every field any of them reads).
ONE_FACT = [
    ("activation_field", "hidden_activation", {"activation"}),
    ("tied_by_default", True, {"tie_word_embeddings"}),
    ("norm_plus_one", True, {"norm_plus_one"}),
    ("sandwich_norms", True, {"sandwich_norms"}),
    ("embed_scale", True, {"embed_scale"}),
    ("query_pre_attn_scalar", True, {"query_scale"}),
    ("softcapping", True, {"attn_softcap", "final_softcap"}),
]


@pytest.mark.parametrize(("trait", "value", "changed"), ONE_FACT)
def test_each_trait_is_one_fact(trait: str, value: object, changed: set[str]) -> None:
    """Traits name facts, not families: any one of Gemma's, alone, changes only its own
    part of the config (loading/ reads through the traits it is given, knowing no family)."""
    d = {
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "silu",
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 144,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    }  # fmt: skip
    plain = ModelConfig.from_hf_config(d, Traits())
    one = ModelConfig.from_hf_config(d, Traits(**{trait: value}))
    differ = {f.name for f in fields(ModelConfig) if getattr(plain, f.name) != getattr(one, f.name)}
    assert differ == changed
