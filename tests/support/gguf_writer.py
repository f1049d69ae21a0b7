"""Write a tiny HF model folder as a GGUF, the way llama.cpp's convert_hf_to_gguf.py would.

    path = write_gguf(folder, tmp_path / "tiny.gguf", quantize=False)

The folder is one save_pretrained wrote (tests/support/tiny_model.py's tokenizer). Independent
of shoal's converter on purpose, so a round trip through both tests one against the other:

  - metadata: the keys each llama.cpp model class's set_gguf_parameters writes (TextModel's
    generic ones for llama / qwen2 / qwen3 / qwen3moe / gemma3, Gemma2Model's and
    Phi3MiniModel's own lists), under the arch llama.cpp gives the HF model_type;
  - tensor names: gguf-py's own TensorNameMap, i.e. llama.cpp's table;
  - tensor values as modify_tensors leaves them: llama's Q/K rows permuted (LlamaModel.permute),
    experts stacked into one [experts, out, in] tensor per projection, Gemma's norms + 1,
    Gemma 2's lm_head dropped; rope_freqs (llama3 RoPE) and Phi-3's rope_factors_long/short
    from generate_extra_tensors;
  - the tokenizer as gpt2 BPE metadata: tokens, types (special ones CONTROL), merges, ids,
    chat template.

F32 tensors, or with `quantize` every tensor of two or more dimensions whose rows split into
32-value blocks as Q8_0 (1-D norms and biases stay F32, as llama.cpp keeps them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

# HF model_type -> llama.cpp architecture
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")


def write_gguf(
    folder: Path,
    out: Path,
    *,
    quantize: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """`folder` as llama.cpp would write it (module doc), plus `extra_tensors` as given."""
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny")
    _METADATA[arch](writer, config)
    add_tokenizer(writer, folder, config)
    for name, array in _tensors(folder, config, arch) + list((extra_tensors or {}).items()):
        if quantize and array.ndim >= 2 and array.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- metadata ------------------------------------------------------------------------------


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    params = config.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _text_model(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope(config)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if (experts := config.get("num_local_experts")) is not None:
        writer.add_expert_count(experts)
    if (used := config.get("num_experts_per_tok")) is not None:
        writer.add_expert_used_count(used)
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _llama(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _text_model(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(_head_dim(config))


def _qwen3moe(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _text_model(writer, config)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _gemma2(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """Gemma2Model.set_gguf_parameters: its own list, no RoPE base."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _text_model(writer, config)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(config["sliding_window"])


def _phi3(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """Phi3MiniModel.set_gguf_parameters (it skips TextModel's, so no rope.scaling.type)."""
    rope = config["rope_parameters"]
    original = rope.get(
        "original_max_position_embeddings", config.get("original_max_position_embeddings")
    )
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(_phi3_rotary_dims(config))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)


_METADATA: dict[str, Callable[[gguf.GGUFWriter, dict[str, Any]], None]] = {
    "llama": _llama,
    "qwen2": _text_model,
    "qwen3": _text_model,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path, config: dict[str, Any]) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's metadata: vocabulary, merges, ids."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


# --- tensors -------------------------------------------------------------------------------


def _tensors(folder: Path, config: dict[str, Any], arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, values) for every tensor llama.cpp would write."""
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    state = load_file(folder / "model.safetensors")
    out = _extra_tensors(config, arch)
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in sorted(state.items()):
        if match := _EXPERT.fullmatch(name):
            layer, block, expert, kind = match.groups()
            experts.setdefault((int(layer), block, kind), {})[int(expert)] = tensor
            continue
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch == "llama" and ".self_attn.q_proj." in name:
            tensor = llamacpp_permute(tensor, config["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in name:
            tensor = llamacpp_permute(tensor, config["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        out.append((_gguf_name(names, name), tensor.numpy()))
    for (layer, block, kind), by_expert in sorted(experts.items()):
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        merged = (  # the names LlamaModel / Qwen2MoeModel hand to map_tensor_name
            f"layers.{layer}.feed_forward.experts.{kind}.weight"
            if block == "block_sparse_moe"
            else f"model.layers.{layer}.mlp.experts.{kind}.weight"
        )
        out.append((_gguf_name(names, merged), stacked.numpy()))
    return out


def _gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, f"llama.cpp has no name for {hf_name}"
    return name


def _extra_tensors(config: dict[str, Any], arch: str) -> list[tuple[str, np.ndarray]]:
    """generate_extra_tensors: llama3 rope_freqs (LlamaModel), longrope factors (Phi3)."""
    rope = _rope(config)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        return [("rope_freqs.weight", _llama3_rope_freqs(config, rope))]
    if arch == "phi3" and rope.get("long_factor"):
        return [
            ("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
            ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)),
        ]
    return []


def _llama3_rope_freqs(config: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """LlamaModel.generate_extra_tensors, step for step (original context from the config's
    top level, 8192 when absent, as llama.cpp reads it)."""
    base, dim = rope["rope_theta"], _head_dim(config)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = config.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def llamacpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rows from "rotate half" order to interleaved pairs."""
    shape = weight.shape
    return (
        weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _phi3_rotary_dims(config: dict[str, Any]) -> int:
    partial = config["rope_parameters"].get("partial_rotary_factor", 1.0)
    return int(partial * config["hidden_size"]) // config["num_attention_heads"]
