"""The forward's element-wise shortcuts give the same bits as the formulas they replace."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.model import rms_norm
from shoal.kernels.rope import apply_rope


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm, spelled out."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 7, 64, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_equal_to_the_hugging_face_formula(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))


def test_rotating_q_and_k_together_equals_rotating_each() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 5, 9, 3, 64
    qk = torch.randn(tokens, heads + kv_heads, dim, generator=gen)
    cos, sin = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
    together = apply_rope(qk, cos, sin)
    assert torch.equal(together[:, :heads], apply_rope(qk[:, :heads], cos, sin))
    assert torch.equal(together[:, heads:], apply_rope(qk[:, heads:], cos, sin))
