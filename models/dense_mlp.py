"""A layer's dense MLP (not a mixture of experts), as transformers computes it:
down(act(gate) * up) over the fused gate_up projection, SiLU or Gemma's tanh GELU. Where both
matmuls are bfloat16 and the element-wise ops compiled, the activation stays bfloat16 between
them (kernels/bf16_mlp.py); a gate_up in gated panels gives the activation itself
(`silu_mul`: float32, or bfloat16 from gated bfloat16 panels, which the down takes as it is);
else the product, then silu_mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.bf16_gated import GatedBf16Linear
from shoal.kernels.bf16_mlp import bf16_pair
from shoal.kernels.elementwise import CompiledElementwise, Elementwise
from shoal.kernels.int8_gated import GatedInt8Linear
from shoal.kernels.linear import GatedPanels
from shoal.models.weights import DenseWeights


def dense_mlp(
    mlp: DenseWeights,
    x: torch.Tensor,
    elementwise: Elementwise,
    activation: str,
    rows: int | None = None,
) -> torch.Tensor:
    """[.., hidden] -> [.., hidden]; `rows`: the rows the step stands for (linear.py)."""
    silu = activation == "silu"
    compiled = silu and isinstance(elementwise, CompiledElementwise)
    pair = bf16_pair(mlp.gate_up, mlp.down, x, rows) if compiled else None
    if pair is not None:  # bfloat16 from the gate_up's product to the down's input
        return pair.run(x, elementwise.silu_mul)
    if isinstance(mlp.gate_up, GatedPanels | GatedInt8Linear | GatedBf16Linear):
        return mlp.down(mlp.gate_up.silu_mul(x, rows), rows)
    gate_up = mlp.gate_up(x, rows)
    if silu:
        return mlp.down(elementwise.silu_mul(gate_up), rows)
    gate, up = gate_up.chunk(2, dim=-1)
    return mlp.down(F.gelu(gate, approximate="tanh") * up, rows)
