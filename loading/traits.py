"""What a model family's code fixes and its config.json does not say.

Each family file in models/ declares its `Traits`; `ModelConfig.from_hf_config` reads
config.json through them (which fields exist, which layers slide, how experts route), so one
reader serves every family and a family's quirks live in its own file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Which layers use sliding-window attention when config.json has no `layer_types` list
# (transformers 5 writes one for most families; older configs and Mistral's do not):
#   none     no layer slides
#   all      every layer, when sliding_window is set (Mistral, Phi-3, Mixtral)
#   flagged  every layer, when use_sliding_window (Qwen3-MoE)
#   qwen     when use_sliding_window, the layers from max_window_layers on (Qwen2, Qwen3)
#   even     the even layers (Gemma 2)
#   pattern  all but every sliding_window_pattern-th layer (Gemma 3, default 6)
SlidingRule = Literal["none", "all", "flagged", "qwen", "even", "pattern"]

# How a mixture-of-experts family names its expert count and which layers are sparse:
#   mixtral    num_local_experts, every layer sparse, weights always renormalised
#   qwen3_moe  num_experts, every decoder_sparse_step-th layer not in mlp_only_layers,
#              renormalised when norm_topk_prob
MoEStyle = Literal["mixtral", "qwen3_moe"]


@dataclass(frozen=True)
class Traits:
    sliding: SlidingRule = "none"
    # q/k/v projections carry biases whatever the config says (Qwen2); otherwise the config's
    # attention_bias biases q, k, v and o (Llama, Qwen3, Mistral).
    qkv_bias_always: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    # Gemma: norms scale by (1 + w), norms before and after both attention and the MLP, the
    # embedding scaled by sqrt(hidden), queries by query_pre_attn_scalar, optional soft-capping
    # of attention and final logits, and the activation named `hidden_activation`.
    gemma: bool = False
    moe: MoEStyle | None = None
    partial_rotary: bool = False  # RoPE may rotate a leading share of each head (Phi-3)
    # Sliding and full layers have RoPEs of their own (Gemma 3: rope_parameters per layer type,
    # or rope_local_base_freq).
    layer_ropes: bool = False
