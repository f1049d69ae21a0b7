"""A prompt token's matmuls, measured at start where the CPU's mixed-prefill cap is the engine's
to pick (models/prompt_cost.py): one layer a stage, the best of its runs, scaled by the stage's
layers and divided by the rows."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from shoal.models import prompt_cost
from shoal.models.decoder import DecoderModel
from shoal.models.layout import Part
from shoal.models.llama import LLAMA
from shoal.models.load import LoadedModel

CPU = torch.device("cpu")


def staged(tiny_model: LoadedModel, splits: list[range]) -> list[DecoderModel]:
    last = len(splits) - 1
    return [
        LLAMA.build(
            tiny_model.config,
            tiny_model.weights,
            torch.float32,
            CPU,
            "packed",
            part=Part(layers, first=k == 0, last=k == last),
        )
        for k, layers in enumerate(splits)
    ]


def test_the_tiny_model_costs_a_positive_time(tiny_model: LoadedModel) -> None:
    ms = prompt_cost.prompt_token_ms(staged(tiny_model, [range(tiny_model.config.num_layers)]))
    assert math.isfinite(ms) and 0 < ms < 50


def test_each_stage_counts_its_layers_at_the_best_of_its_runs(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer times 9, 2, 5, ... ms: the best (2 ms) a layer; stages of 1 and 3 layers give 4
    layers; 64 rows."""
    layers = tiny_model.config.num_layers
    assert layers >= 2, "the tiny model has the layers to split"
    runs: Iterator[float] = iter([0.009, 0.002, 0.005] * 20)
    monkeypatch.setattr(prompt_cost, "_layer_seconds", lambda model, rows: next(runs))
    models = staged(tiny_model, [range(1), range(1, layers)])
    ms = prompt_cost.prompt_token_ms(models, rows=64, runs=3)
    assert ms == pytest.approx(2.0 * layers / 64)
