"""What a model family's code fixes and its config.json does not say.

Each family file in models/ declares its `Traits`; `ModelConfig.from_hf_config` reads
config.json through them (which fields exist, which layers slide, how experts route), so one
reader serves every family and a family's quirks live in its own file. Every field names one
fact, never a family: a family that shares a fact with another sets the same field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Which layers use sliding-window attention when config.json has no `layer_types` list
# (transformers 5 writes one for most families; older configs and Mistral's do not):
#   none           no layer slides
#   all            every layer, when sliding_window is set (Mistral, Phi-3, Mixtral)
#   flagged        every layer, when use_sliding_window (Qwen3-MoE)
#   flagged_upper  when use_sliding_window, the layers from max_window_layers on (Qwen2, Qwen3)
#   even           the even layers (Gemma 2)
#   pattern        all but every sliding_window_pattern-th layer (Gemma 3, default 6)
SlidingRule = Literal["none", "all", "flagged", "flagged_upper", "even", "pattern"]


@dataclass(frozen=True)
class ExpertTraits:
    """How a mixture-of-experts family's config.json names its experts and routes them."""

    # The expert count: the first of these fields the config has (the last one names the
    # missing field in the error).
    count_fields: tuple[str, ...]
    size_field: str  # each expert's intermediate size
    # Sparse layers: every decoder_sparse_step-th layer not in mlp_only_layers (Qwen3-MoE);
    # otherwise every layer (Mixtral).
    sparse_step: bool = False
    # The chosen experts' weights are renormalised when this config flag is set (Qwen3-MoE's
    # norm_topk_prob); None: always (Mixtral).
    normalize_flag: str | None = None
    # The experts' outputs are weighted by float32 routing weights (Mixtral), not by weights
    # cast to the model's dtype.
    float32_weights: bool = False


@dataclass(frozen=True)
class Traits:
    sliding: SlidingRule = "none"
    # q/k/v projections carry biases whatever the config says (Qwen2); otherwise the config's
    # attention_bias biases q, k, v and o (Llama, Qwen3, Mistral).
    qkv_bias_always: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    # config.json's name for the gated MLP's activation, and the activation when it is absent
    # (Gemma: hidden_activation, gelu_pytorch_tanh).
    activation_field: str = "hidden_act"
    default_activation: str = "silu"
    tied_by_default: bool = False  # tie_word_embeddings when the config omits it (Gemma)
    norm_plus_one: bool = False  # norms scale by 1 + w (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma)
    embed_scale: bool = False  # the embedding is scaled by sqrt(hidden_size) (Gemma)
    # Queries scale by query_pre_attn_scalar ** -0.5 (head_dim when absent) (Gemma).
    query_pre_attn_scalar: bool = False
    # Attention scores and final logits are soft-capped by attn_logit_softcapping and
    # final_logit_softcapping when the config sets them (Gemma 2; Gemma 3 sets none).
    softcapping: bool = False
    experts: ExpertTraits | None = None  # a mixture-of-experts MLP (Mixtral, Qwen3-MoE)
    partial_rotary: bool = False  # RoPE may rotate a leading share of each head (Phi-3)
    # Sliding and full layers have RoPEs of their own (Gemma 3: rope_parameters per layer type,
    # or rope_local_base_freq).
    layer_ropes: bool = False
