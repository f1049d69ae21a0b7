"""A GGUF file's tensors under their HF names, with llama.cpp's changes to their values undone.

Names: `token_embd` / `output_norm` / `output` are model.embed_tokens / model.norm / lm_head
everywhere; inside `blk.N.` the names below map to `model.layers.N.` + the HF suffix. What
convert_hf_to_gguf.py does to the values, and what is undone here:

    llama      attn_q / attn_k rows (weights and biases) permuted per head from HF's "rotate
               half" layout to interleaved pairs: unpermute_rope_rows.
               Mixtral's experts stacked into ffn_{gate,up,down}_exps [experts, out, in]:
               split back into block_sparse_moe.experts.E.w1 / w3 / w2 (files from before
               the stacking name each expert's own: blk.N.ffn_gate.E, ...).
    qwen3moe   the same stacking: split back into mlp.experts.E.gate_proj / up_proj / down_proj
    gemma2/3   every RMSNorm weight stored as w + 1 (HF's Gemma norm multiplies by 1 + w):
               minus 1 here. Exact for weights born in bf16 (every real Gemma checkpoint):
               their w + 1 fits float32's mantissa; a float32 w loses its bits below 2**-23.
    phi3       kept fused as HF has them: attn_qkv = qkv_proj, ffn_up = gate_up_proj ([gate;
               up] rows); split attn_q / attn_k / attn_v (also allowed by llama.cpp) are fused.

Biases HF's model always has but the file may leave out (Qwen2's q/k/v, or all four attention
biases when attention_bias is set) are written as zeros, which is what llama.cpp computes with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shoal.loading.checkpoint import CheckpointError
from shoal.loading.gguf_metadata import GGUFMetadata, dequantized
from shoal.loading.gguf_rope import ROPE_TENSORS

if TYPE_CHECKING:
    from tqdm import tqdm

_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_DENSE = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA = _DENSE | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# "{e}" marks a stacked expert tensor: one HF tensor per expert.
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _DENSE
    | {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    },
    "qwen2": _DENSE,
    "qwen3": _DENSE | _QK_NORM,
    "qwen3moe": {k: v for k, v in (_DENSE | _QK_NORM).items() if not k.startswith("ffn_")}
    | {
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
    },
    "gemma2": _GEMMA,
    "gemma3": _GEMMA | _QK_NORM,
    "phi3": {k: v for k, v in _DENSE.items() if k not in ("ffn_gate", "ffn_up")}
    | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight; a stacked expert tensor's name holds "{e}" for the
    expert index; None for names we do not know."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) not in (3, 4) or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer_names = _LAYER_NAMES.get(arch, {})
    if len(parts) == 4:  # blk.N.ffn_gate.E: one expert of an early Mixtral file
        if not parts[3].isdigit() or f"{parts[2]}_exps" not in layer_names:
            return None
        expert_name = layer_names[f"{parts[2]}_exps"].format(e=int(parts[3]))
        return f"model.layers.{parts[1]}.{expert_name}.{suffix}"
    if parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def gguf_weights(
    meta: GGUFMetadata, config: dict[str, Any], bar: tqdm | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name, llama.cpp's changes undone."""
    weights: dict[str, torch.Tensor] = {}
    for tensor in meta.tensors:
        if tensor.name not in ROPE_TENSORS:  # settings, read into the config
            name = hf_name(tensor.name, meta.arch)
            if name is None:
                raise CheckpointError(
                    f"GGUF tensor {tensor.name!r} has no HF counterpart in {meta.arch} we know"
                )
            weight = _undo_llamacpp(name, torch.from_numpy(dequantized(tensor)), meta, config)
            if "{e}" in name:
                _split_experts(name, weight, config, weights)
            else:
                weights[name] = weight
        if bar is not None:
            bar.update()
    if meta.arch == "phi3":
        _fuse_qkv(weights)
    _add_zero_biases(weights, config)
    return weights


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k projection rows (weights or biases).

    llama.cpp's convert_hf_to_gguf.py reorders each head's rows from HF's "rotate half" layout
    (first half of the head dim, then second half) to interleaved pairs:
    `w.reshape(heads, 2, half, ...).swapaxes(1, 2)`. This is its inverse, exactly as in
    transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    permuted = weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
    return permuted.reshape(weight.shape).contiguous()


def _undo_llamacpp(
    name: str, weight: torch.Tensor, meta: GGUFMetadata, config: dict[str, Any]
) -> torch.Tensor:
    """The value HF had before convert_hf_to_gguf.py changed it (see module doc)."""
    if meta.arch == "llama":
        if ".self_attn.q_proj." in name:
            return unpermute_rope_rows(weight, config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_rope_rows(weight, config["num_key_value_heads"])
    if meta.arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return weight - 1.0
    return weight


def _split_experts(
    name: str, stacked: torch.Tensor, config: dict[str, Any], weights: dict[str, torch.Tensor]
) -> None:
    """One [experts, out, in] tensor into each expert's own (copies: safetensors refuses views
    that share memory)."""
    num_experts = config.get("num_local_experts", config.get("num_experts"))
    if stacked.dim() != 3 or stacked.shape[0] != num_experts:
        raise CheckpointError(
            f"GGUF expert tensor for {name.format(e='*')} has shape {list(stacked.shape)}, "
            f"expected [{num_experts}, out, in]"
        )
    for expert in range(num_experts):
        weights[name.format(e=expert)] = stacked[expert].clone()


def _fuse_qkv(weights: dict[str, torch.Tensor]) -> None:
    """Phi-3 split q/k/v projections into its fused qkv_proj ([q; k; v] rows)."""
    for q_name in [n for n in weights if n.endswith(".self_attn.q_proj.weight")]:
        prefix = q_name.removesuffix("q_proj.weight")
        parts = [weights.pop(f"{prefix}{p}_proj.weight", None) for p in ("q", "k", "v")]
        if any(p is None for p in parts):
            raise CheckpointError(f"GGUF phi3 layer {prefix} has only some of attn_q/k/v")
        weights[f"{prefix}qkv_proj.weight"] = torch.cat([p for p in parts if p is not None])


def _add_zero_biases(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Zeros for the attention biases the HF model has and the file left out."""
    if config["model_type"] == "qwen2":
        projections: tuple[str, ...] = ("q", "k", "v")
    elif config.get("attention_bias"):
        projections = ("q", "k", "v", "o")
    else:
        return
    for layer in range(config["num_hidden_layers"]):
        for projection in projections:
            prefix = f"model.layers.{layer}.self_attn.{projection}_proj"
            if f"{prefix}.bias" not in weights and f"{prefix}.weight" in weights:
                rows = weights[f"{prefix}.weight"].shape[0]
                weights[f"{prefix}.bias"] = torch.zeros(rows, dtype=torch.float32)
