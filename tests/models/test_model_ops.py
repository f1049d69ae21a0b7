"""The forward's element-wise shortcuts give the same bits as the formulas they replace, and
its weights stay its own."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.elementwise import rms_norm
from shoal.kernels.linear import LinearKind
from shoal.kernels.rope import apply_rope
from shoal.models.llama import LLAMA
from shoal.models.load import LoadedModel


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


@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_a_weight_update_never_keeps_the_callers_tensors(
    tiny_model: LoadedModel, kind: LinearKind
) -> None:
    """After `load`, the caller may change its tensors in place (a trainer's step): the model
    reads its own copies, in every linear kind and at every row count."""
    cpu = torch.device("cpu")
    config = tiny_model.config
    model = LLAMA.build(config, tiny_model.weights, torch.float32, cpu, kind)
    update = {name: tensor * 1.5 for name, tensor in tiny_model.weights.items()}
    model.load(update)
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
    widths = [hidden] + [hidden, q_size, hidden, config.intermediate_size] * config.num_layers
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(200, width, generator=gen) for width in widths]
    linears = model.weights.linears()

    def outputs() -> list[torch.Tensor]:
        return [f(x[:rows]) for f, x in zip(linears, inputs, strict=True) for rows in (1, 5, 200)]

    before = outputs()
    for tensor in update.values():
        tensor.mul_(-3.0)
    after = outputs()
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b, a)
