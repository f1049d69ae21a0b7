"""Rotary position embeddings as Hugging Face transformers 5 computes them (non-interleaved halves).

    rope_tables(rotary_dim, theta, scaling, max_positions) -> (cos, sin)
        float32 [max_positions, rotary_dim]; row p rotates the token at position p. The type's
        attention factor (yarn's mscale, longrope's attention_factor) is already multiplied in,
        as transformers' rotary embeddings multiply it into the cos and sin they return.
    rope_context_limit(scaling, max_positions) -> how many positions those tables are exact for
    partial_rotary_dim(head_dim, partial_rotary_factor) -> rotary_dim (Phi-4-mini rotates 3/4)
    apply_rope(x, cos, sin) -> x with the first cos.shape[-1] features of each head rotated

`scaling` is read_rope's dict (loading/rope_config.py): the type under "rope_type" and
its fields, with original_max_position_embeddings and longrope's factor already resolved from the
config's top-level fields as transformers resolves them; None is plain RoPE. Each type repeats,
op for op, the function transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS names for it, so the
tables equal transformers' cos and sin bit for bit when computed on the same device
(tests/kernels/test_rope.py checks every type against the models' RotaryEmbedding modules):

    default   1 / theta ** (2i / rotary_dim)
    linear    default / factor
    llama3    low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1+)
    yarn      a ramp by dimension between interpolated (/ factor) and extrapolated frequencies;
              cos and sin times attention_factor, else the mscale formula (Qwen 2.5/3, DeepSeek)
    longrope  default / short_factor[i] before original_max_position_embeddings, / long_factor[i]
              from it on; cos and sin times attention_factor (Phi-3, Phi-4-mini)
    dynamic   the default frequencies, exact up to rope_context_limit (see there)
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's type ("rope_type", or the old key "type"); "default" for None."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_tables(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin, [max_positions, rotary_dim], attention factor included.

    Exact for positions below rope_context_limit(scaling, max_positions). longrope switches
    per position: rows below original_max_position_embeddings use short_factor, rows from it
    on long_factor, so a position's rotation never depends on the batch it is in. transformers
    instead picks one set for every position of a sequence, the long one as soon as the
    sequence passes original_max_position_embeddings; the two agree exactly while a sequence
    stays within the original context, and past it differ on the positions before it.
    """
    if rope_type(scaling) == "longrope":
        assert scaling is not None
        return _longrope_tables(rotary_dim, theta, scaling, max_positions)
    inv_freq, attention_factor = _frequencies(rotary_dim, theta, scaling)
    return cos_sin_table(inv_freq, max_positions, attention_factor)


def rope_context_limit(scaling: dict[str, Any] | None, max_positions: int) -> int:
    """The most positions rope_tables' rows equal transformers' for; cap the context there.

    transformers' dynamic NTK recomputes the frequencies from the current sequence length once
    a sequence passes max_position_embeddings, so a position's rotation would depend on the
    sequence it is in; a batched server with one table cannot reproduce that. Below that length
    dynamic is the default RoPE, so shoal serves dynamic with the default frequencies and the
    context capped at original_max_position_embeddings when the scaling names it (never above
    max_positions, the config's max_position_embeddings), else at max_positions.
    Every other type: max_positions.
    """
    if rope_type(scaling) != "dynamic":
        return max_positions
    assert scaling is not None
    original = scaling.get("original_max_position_embeddings")
    return max_positions if original is None else min(max_positions, int(original))


def partial_rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """How many features of each head RoPE rotates: int(head_dim * factor), as transformers."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"head_dim {head_dim} * partial_rotary_factor {partial_rotary_factor} gives "
            f"{rotary_dim} rotated features; RoPE needs a positive even number"
        )
    return rotary_dim


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The per-pair inverse frequencies (rotary_dim // 2) of every type but longrope, whose
    frequencies depend on the position (rope_tables handles it). Without the attention factor."""
    return _frequencies(rotary_dim, theta, scaling)[0]


def cos_sin_table(
    inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, 2 * len(inv_freq)] cos and sin tables (float32), times attention_factor."""
    return _table(inv_freq, torch.arange(max_positions, dtype=torch.float32), attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, R] for each token's position, R <= D. The first R features of
    each head are rotated as two halves; the other D - R pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _table(
    inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for float32 positions, in the order of transformers' rotary forward."""
    freqs = positions[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor) for every type but longrope."""
    kind = rope_type(scaling)
    if kind in ("default", "dynamic"):
        return _default(rotary_dim, theta), 1.0
    assert scaling is not None
    if kind == "linear":
        return _default(rotary_dim, theta) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(_default(rotary_dim, theta), scaling), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling)
    if kind == "longrope":
        raise ValueError("longrope's frequencies depend on the position; use rope_tables")
    raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _default(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: pairs that turn fewer than beta_slow times over the original context are
    interpolated (/ factor), those that turn more than beta_fast times kept, a ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            ratio = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            attention_factor = float(ratio)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    low = _yarn_correction_dim(beta_fast, rotary_dim, theta, original)
    high = _yarn_correction_dim(beta_slow, rotary_dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_weight = 1 - torch.clamp(ramp, 0, 1)

    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, rotary_dim: int, theta: float, original: int) -> float:
    """The (fractional) dimension whose pair turns `rotations` times over `original` positions."""
    return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _longrope_tables(
    rotary_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Short factors for positions below original_max_position_embeddings, long ones after."""
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor")
        if factor is None:
            raise ValueError("longrope needs factor or attention_factor (read_rope fills factor)")
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    positions = torch.arange(max_positions, dtype=torch.float32)
    split = min(int(original), max_positions)
    short = _longrope_inv_freq(rotary_dim, theta, scaling, "short_factor")
    long = _longrope_inv_freq(rotary_dim, theta, scaling, "long_factor")
    cos_short, sin_short = _table(short, positions[:split], attention_factor)
    cos_long, sin_long = _table(long, positions[split:], attention_factor)
    return torch.cat((cos_short, cos_long)), torch.cat((sin_short, sin_long))


def _longrope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any], name: str
) -> torch.Tensor:
    ext_factors = torch.tensor(scaling[name], dtype=torch.float32)
    if ext_factors.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope {name} has {len(scaling[name])} entries, not {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext_factors * theta**exponents)
