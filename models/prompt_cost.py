"""What one prompt token costs this model on this machine: the milliseconds of its matmuls, as
a chunk of `rows` tokens computes them, measured once at start where the CPU's mixed-prefill
cap is left to the engine (resolve_options.py: measured_mixed_prefill; api/startup.py).

A prompt chunk beside running decodes lengthens their step by about its matmuls' time: the
projections and MLP of every layer (its attention over a short context and its element-wise
ops are a small part on the CPU). One layer of each stage is timed on random rows, the best of
a few runs (a shared machine's noise only ever adds), and scaled by the stage's layers:

    ms = prompt_token_ms([stage.model for stage in stages])   # SmolLM2, bfloat16, Zen 5: ~0.27
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from shoal.kernels.moe import Experts
from shoal.models.decoder import DecoderModel
from shoal.models.dense_mlp import dense_mlp

ROWS = 64  # a chunk's tokens, timed at once
RUNS = 10  # the best of them: the first call may pack and allocate


@torch.inference_mode()
def prompt_token_ms(models: Sequence[DecoderModel], rows: int = ROWS, runs: int = RUNS) -> float:
    """The matmuls' milliseconds a prompt token adds to a step, all stages' layers together."""
    total = 0.0
    for model in models:
        layers = model.weights.layers
        if layers:
            best = min(_layer_seconds(model, rows) for _ in range(runs))
            total += best * len(layers)
    return total * 1e3 / rows


def _layer_seconds(model: DecoderModel, rows: int) -> float:
    """One pass of the first layer's projections and MLP over `rows` random rows."""
    cfg = model.config
    layer = model.weights.layers[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cfg.hidden_size, generator=generator).to(model.device, model.dtype)
    attended = torch.randn(rows, cfg.num_heads * cfg.head_dim, generator=generator)
    attended = attended.to(model.device, model.dtype)
    began = time.perf_counter()
    layer.qkv(x, rows)
    layer.o(attended, rows)
    if isinstance(layer.mlp, Experts):
        layer.mlp(x)
    else:
        dense_mlp(layer.mlp, x, model.elementwise, cfg.activation, rows)
    return time.perf_counter() - began
