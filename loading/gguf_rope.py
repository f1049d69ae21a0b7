"""A GGUF file's RoPE settings back in HF's spelling: a transformers 5 `rope_parameters` dict.

llama.cpp keeps RoPE scaling in three places, by what convert_hf_to_gguf.py wrote:

    {arch}.rope.scaling.type / .factor / .original_context_length / .yarn_*
        linear and yarn (any architecture), from HF rope_type linear / yarn
    rope_freqs.weight                 (llama)  one factor per rotary pair: HF rope_type llama3,
        computed from factor, low/high_freq_factor and original_max_position_embeddings, which
        the file does not keep. They are found again by recomputing the tensor for the settings
        every Llama 3.x ships with (low 1, high 4, original context 8192, factor the largest
        entry) and refused when that does not reproduce it.
    rope_factors_long/short.weight    (phi3)   HF rope_type longrope's long_factor and
        short_factor, with {arch}.rope.scaling.attn_factor and original_context_length
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.loading.checkpoint import CheckpointError
from shoal.loading.gguf_metadata import GGUFMetadata

# Tensors that carry RoPE settings, not weights: read here, never written to the safetensors.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# (low_freq_factor, high_freq_factor, original_max_position_embeddings) tried for rope_freqs.
_LLAMA3_SETTINGS = ((1.0, 4.0, 8192),)


def rope_parameters(
    meta: GGUFMetadata, theta: float, *, rotary_dims: int, max_positions: int
) -> dict[str, Any]:
    """The HF rope_parameters for this file: {"rope_type", "rope_theta", ...the scaling's}."""
    if meta.has_tensor("rope_freqs.weight"):
        return _llama3(meta.tensor_values("rope_freqs.weight"), theta, rotary_dims)
    if meta.has_tensor("rope_factors_long.weight"):
        return _longrope(meta, theta, rotary_dims, max_positions)
    kind = meta.arch_value("rope.scaling.type")
    factor = meta.arch_value("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and (factor is None or factor == 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if factor is None:
        raise CheckpointError(f"GGUF rope scaling {kind!r} has no {meta.arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    if kind == "yarn":
        return _yarn(meta, theta, float(factor))
    raise CheckpointError(
        f"GGUF rope scaling type {kind!r} is not supported (none, linear, yarn, or llama3 / "
        "longrope factors as tensors)"
    )


def llama3_factors(
    theta: float, rotary_dims: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """rope_freqs as convert_hf_to_gguf.py computes it for HF rope_type llama3."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    factors = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    return factors.astype(np.float32)


def _llama3(factors: np.ndarray, theta: float, rotary_dims: int) -> dict[str, Any]:
    if factors.shape != (rotary_dims // 2,):
        raise CheckpointError(
            f"GGUF rope_freqs has shape {list(factors.shape)}, expected [{rotary_dims // 2}]"
        )
    factor = float(factors.max())
    for low, high, original in _LLAMA3_SETTINGS:
        expected = llama3_factors(theta, rotary_dims, factor, low, high, original)
        if np.allclose(factors, expected, rtol=1e-5, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
                "rope_theta": theta,
            }
    raise CheckpointError(
        "GGUF rope_freqs are not llama3 RoPE scaling with the usual settings (low_freq_factor 1, "
        "high_freq_factor 4, original context 8192), so they cannot be turned back into "
        "rope_scaling; load the original HF folder instead"
    )


def _longrope(
    meta: GGUFMetadata, theta: float, rotary_dims: int, max_positions: int
) -> dict[str, Any]:
    if not meta.has_tensor("rope_factors_short.weight"):
        raise CheckpointError("GGUF has rope_factors_long but no rope_factors_short")
    long_factor = meta.tensor_values("rope_factors_long.weight").tolist()
    short_factor = meta.tensor_values("rope_factors_short.weight").tolist()
    if len(long_factor) != rotary_dims // 2 or len(short_factor) != rotary_dims // 2:
        raise CheckpointError(
            f"GGUF rope_factors_long/short have {len(long_factor)}/{len(short_factor)} entries, "
            f"expected {rotary_dims // 2} (half the rotary dimensions)"
        )
    original = int(meta.arch_value("rope.scaling.original_context_length", max_positions))
    params: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [float(np.float32(v)) for v in long_factor],
        "short_factor": [float(np.float32(v)) for v in short_factor],
        "original_max_position_embeddings": original,
        "rope_theta": theta,
    }
    attn_factor = meta.arch_value("rope.scaling.attn_factor")
    scale = max_positions / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=1e-6):
        params["attention_factor"] = float(attn_factor)  # HF derives the default itself
    return params


def _yarn(meta: GGUFMetadata, theta: float, factor: float) -> dict[str, Any]:
    original = meta.arch_value("rope.scaling.original_context_length")
    if original is None:
        raise CheckpointError(
            f"GGUF yarn RoPE scaling has no {meta.arch}.rope.scaling.original_context_length"
        )
    params: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "rope_theta": theta,
    }
    for gguf_key, hf_key in (
        ("yarn_attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        if (value := meta.arch_value(f"rope.scaling.{gguf_key}")) is not None:
            params[hf_key] = float(value)
    return params
