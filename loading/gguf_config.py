"""The config.json a GGUF file's metadata describes, as transformers' save_pretrained writes it.

One builder per llama.cpp architecture turns its metadata (the keys convert_hf_to_gguf.py writes)
into the keyword arguments of the transformers config class; the class then spells config.json
(transformers 5: rope_parameters, layer_types, ...), so the converted folder reads exactly like
one saved from the original model:

    llama     -> llama       LlamaForCausalLM    (Mistral too: llama.cpp stores it as llama)
    llama + {arch}.expert_count
              -> mixtral     MixtralForCausalLM
    qwen2     -> qwen2       Qwen2ForCausalLM
    qwen3     -> qwen3       Qwen3ForCausalLM
    qwen3moe  -> qwen3_moe   Qwen3MoeForCausalLM
    gemma2    -> gemma2      Gemma2ForCausalLM
    gemma3    -> gemma3_text Gemma3ForCausalLM   (the text model; vision weights are a separate
                                                  mmproj file in llama.cpp)
    phi3      -> phi3        Phi3ForCausalLM

What llama.cpp does not store but hard-codes per architecture is put back the way llama.cpp
runs it: Gemma's sliding-window layer pattern (every 2nd layer full for Gemma 2, every 6th for
Gemma 3) and local RoPE base (10000 for Gemma 3), Gemma's query scale (1/sqrt(head_dim), or
1/sqrt(hidden/heads) for the 27B models, which llama.cpp recognises by their layer count), and
Qwen3-MoE's normalised top-k routing weights. Every field the file states is set even where it
equals the class default, since a default is some other checkpoint's value.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

from shoal.loading.checkpoint import CheckpointError
from shoal.loading.gguf_common import (
    ConfigKwargs,
    GGUFCommon,
    attention_biases,
    required_int,
)
from shoal.loading.gguf_metadata import GGUFMetadata


def gguf_hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """config.json's dict for this file: the kwargs below, spelled by the transformers class."""
    kwargs = hf_config_kwargs(meta)
    transformers = importlib.import_module("transformers")  # by name: see GGUFReader
    config = transformers.AutoConfig.for_model(**kwargs)
    text: str = config.to_json_string(use_diff=True)  # what save_pretrained writes
    result: dict[str, Any] = json.loads(text)
    return result


def hf_config_kwargs(meta: GGUFMetadata) -> ConfigKwargs:
    """The transformers config class's kwargs (model_type included) for this file."""
    builder = _BUILDERS.get(meta.arch)
    if builder is None:
        raise CheckpointError(
            f"GGUF architecture {meta.arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return builder(meta, GGUFCommon(meta))


def _llama(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    kwargs = common.kwargs | {"hidden_act": "silu", "rope_parameters": common.rope(meta)}
    num_experts = int(meta.arch_value("expert_count", 0))
    if num_experts == 0:
        return kwargs | {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "head_dim": common.head_dim,
            "attention_bias": attention_biases(meta),
            "mlp_bias": False,
        }
    if attention_biases(meta):
        raise CheckpointError("GGUF llama file with experts (Mixtral) has attention biases")
    # MixtralConfig leaves head_dim unset (None) when it is hidden / heads.
    usual_head_dim = common.head_dim == common.hidden_size // common.num_heads
    return kwargs | {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "head_dim": None if usual_head_dim else common.head_dim,
        "num_local_experts": num_experts,
        "num_experts_per_tok": required_int(meta, "expert_used_count"),
        "sliding_window": None,  # llama.cpp keeps no window for llama; it attends to all
    }


def _qwen2(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    # Qwen2 always has q/k/v biases (gguf_tensors.py supplies zeros where the file has none).
    return common.kwargs | {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "rope_parameters": common.rope(meta),
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _qwen3(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    return common.kwargs | {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": common.head_dim,
        "hidden_act": "silu",
        "attention_bias": attention_biases(meta),
        "rope_parameters": common.rope(meta),
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _qwen3moe(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    num_experts = required_int(meta, "expert_count")
    num_used = required_int(meta, "expert_used_count")
    if int(meta.arch_value("expert_shared_count", 0)):
        raise CheckpointError("GGUF qwen3moe file has shared experts, which Qwen3-MoE has not")
    kwargs = _qwen3(meta, common)
    # llama.cpp's default when the expert width is not stated: the dense width split over
    # the experts used.
    dense = kwargs["intermediate_size"]
    moe_width = meta.arch_value("expert_feed_forward_length")
    if moe_width is None:
        if dense is None:
            raise CheckpointError("GGUF qwen3moe file states no feed-forward width")
        moe_width = dense // num_used
    return kwargs | {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": int(dense if dense is not None else moe_width),
        "moe_intermediate_size": int(moe_width),
        "num_experts": num_experts,
        "num_experts_per_tok": num_used,
        # llama.cpp always renormalises qwen3moe's top-k routing weights (a fixed argument of
        # its graph, not a key it reads).
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma2(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    window = int(meta.arch_value("attention.sliding_window", 4096))  # llama.cpp's default
    return common.kwargs | {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        **_gemma_attention(meta, common, window, default_pattern=2, layers_27b=46),
        "attn_logit_softcapping": float(meta.arch_value("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.arch_value("final_logit_softcapping", 30.0)),
        "rope_parameters": common.rope(meta),
    }


def _gemma3(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    window = int(meta.arch_value("attention.sliding_window", 0))
    final_softcap = meta.arch_value("final_logit_softcapping")
    local_theta = float(meta.arch_value("rope.freq_base_swa", 10000.0))  # llama.cpp's fixed base
    return common.kwargs | {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **_gemma_attention(meta, common, window, default_pattern=6, layers_27b=62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None if final_softcap is None else float(final_softcap),
        # The file's scaling (linear for Gemma 3 4B and up) applies to the global layers only.
        "rope_parameters": {
            "full_attention": common.rope(meta),
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "use_bidirectional_attention": False,
    }


def _gemma_attention(
    meta: GGUFMetadata, common: GGUFCommon, window: int, *, default_pattern: int, layers_27b: int
) -> ConfigKwargs:
    """Gemma's attention fields: which layers slide, the window, the query scale."""
    hidden, heads, layers = common.hidden_size, common.num_heads, common.num_layers
    sliding = _sliding_layers(meta, layers, default_pattern) if window else [False] * layers
    return {
        "head_dim": common.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": attention_biases(meta),
        # No window (every layer global): HF Gemma still builds a sliding mask, so give it one
        # as long as the context, which no layer uses.
        "sliding_window": window or common.max_positions,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        # llama.cpp: 1/sqrt(hidden/heads) for the 27B model (told by its layer count), else
        # 1/sqrt(head_dim); HF scales by query_pre_attn_scalar**-0.5.
        "query_pre_attn_scalar": hidden // heads if layers == layers_27b else common.head_dim,
    }


def _sliding_layers(meta: GGUFMetadata, num_layers: int, default_pattern: int) -> list[bool]:
    """Which layers use the sliding window: {arch}.attention.sliding_window_pattern as a
    per-layer array or a period N (all but every Nth layer slide), else llama.cpp's fixed N."""
    found = meta.values(f"{meta.arch}.attention.sliding_window_pattern")
    if found and isinstance(found[0], bool):
        if len(found) != num_layers:
            raise CheckpointError(
                f"GGUF sliding_window_pattern has {len(found)} entries for {num_layers} layers"
            )
        return [bool(v) for v in found]
    period = int(found[0]) if found else default_pattern
    return [period == 0 or i % period < period - 1 for i in range(num_layers)]


def _phi3(meta: GGUFMetadata, common: GGUFCommon) -> ConfigKwargs:
    if common.head_dim != common.hidden_size // common.num_heads:
        raise CheckpointError(f"GGUF phi3 head dim {common.head_dim} != hidden / heads")
    if attention_biases(meta) or meta.has_tensor("blk.0.attn_qkv.bias"):
        raise CheckpointError("GGUF phi3 file has attention biases, which Phi-3 has not")
    rope = common.rope(meta, partial=True)
    rope["partial_rotary_factor"] = common.rotary_dims / common.head_dim
    # llama.cpp writes 0 for "no window", and runs Phi-3 without one either way.
    window = int(meta.arch_value("attention.sliding_window", 0))
    original = meta.arch_value("rope.scaling.original_context_length", common.max_positions)
    return common.kwargs | {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "hidden_act": "silu",
        "original_max_position_embeddings": int(original),
        "rope_parameters": rope,
        "sliding_window": window or None,
    }


_BUILDERS: dict[str, Callable[[GGUFMetadata, GGUFCommon], ConfigKwargs]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
SUPPORTED_ARCHITECTURES = tuple(_BUILDERS)
