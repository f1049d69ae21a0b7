"""A model split into parts (models/layout.py, `Part`) computes what the whole model
does: the parts' layers one after the other, each with the K/V of its own layers only, give the
whole model's logits; and `split_layers` covers the model or refuses."""

from __future__ import annotations

import pytest
import torch

from shoal.actors.executor.stages import split_layers
from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import BatchShape
from shoal.models.kv_pool import KVPool
from shoal.models.layout import Part
from shoal.models.load import LoadedModel
from shoal.models.registry import family_of


@pytest.mark.parametrize("cut", [1])
def test_two_parts_give_the_whole_models_logits(tiny_model: LoadedModel, cut: int) -> None:
    config, cpu = tiny_model.config, torch.device("cpu")
    family = family_of(config.model_type)
    whole = family.build(config, tiny_model.weights, torch.float32, cpu)
    parts = [
        family.build(config, tiny_model.weights, torch.float32, cpu, part=part)
        for part in (
            Part(range(cut), True, False),
            Part(range(cut, config.num_layers), False, True),
        )
    ]
    assert parts[0].weights.lm_head is None and parts[1].weights.embed is None
    ids = torch.randint(3, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    positions, sample = torch.arange(20), torch.tensor([5, 19])
    shape = BatchShape((0,), (0,), (20,))
    table = torch.arange(32).view(1, 32)
    attention = TorchAttention(1).prepare(table, shape)
    expected = whole.forward(
        ids, positions, attention, KVPool(config, 32, torch.float32, cpu), sample
    )
    h = parts[0].embed(ids)
    for part in parts:
        pool = KVPool(config, 32, torch.float32, cpu, num_layers=len(part.part.layers))
        h = part.run_layers(h, positions, TorchAttention(1).prepare(table, shape), pool)
    assert torch.equal(parts[1].head(h, sample), expected)


def test_split_layers_evenly_or_as_given() -> None:
    assert split_layers(30, 4, None) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert split_layers(30, 2, "10,20") == [range(0, 10), range(10, 30)]
    with pytest.raises(ValueError, match="add up to the model's 30 layers"):
        split_layers(30, 2, "10,10")
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        split_layers(2, 3, None)
