"""A tiny random model folder of each family shoal serves, built by transformers itself.

    folder = make_family_folder(tmp_path / "gemma2", "gemma2", seed=0)

Each is written by the family's own transformers class (`save_pretrained`), so transformers
loads it as the oracle and shoal reads the same files. Every parameter is drawn from a seeded
generator as in tiny_model.py (std 0.2, norms 1 +- 0.1, or +- 0.1 where the family scales by
1 + w), so greedy argmax is far from ties. Windowed families get a window of WINDOW tokens, so
that the parity tests' prompts (up to ~100 tokens) are several windows long; Gemma 2's
soft-capping values are small enough to change the scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_model import BOS_ID, EOS_ID, PAD_ID, save_seeded

WINDOW = 16
VOCAB = 512

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

# family -> (transformers config class name, model class name, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, use_sliding_window=False),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
            num_hidden_layers=3,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
}

# Families whose norms scale by 1 + w: their norm weights are drawn around 0.
_PLUS_ONE = ("gemma2", "gemma3")


def make_family_folder(path: Path, family: str, *, seed: int = 0, init_std: float = 0.2) -> Path:
    """Write a tiny random model of `family` (a key of FAMILIES) into `path`."""
    import transformers

    config_name, model_name, overrides = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **overrides})
    model = getattr(transformers, model_name)(config)
    norm_mean = 0.0 if family in _PLUS_ONE else 1.0
    return save_seeded(model, path, VOCAB, seed=seed, init_std=init_std, norm_mean=norm_mean)
