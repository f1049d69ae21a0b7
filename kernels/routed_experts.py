"""The routed experts of some positions of a batch: for each, every layer's top-k expert ids,
as the router of that layer chose them (SGLang's `return_routed_experts`, which RL trainers
replay: slime's rollout routing replay, AReaL, verl).

    recorder = ExpertRecorder(places, num_layers, top_k)   # places: int64 [M] of the batch
    h = model.run_layers(h, positions, attention, kv, recorder)
    ids = recorder.ids()                                   # int32 [M, num_layers, top_k]

Every layer has a row, as SGLang's answer has (its layer axis is the model's
num_hidden_layers): a dense layer's row (Qwen3-MoE's mlp_only_layers) stays 0, as SGLang's
capture buffer leaves it. The ids of one position run by falling routing probability (the
router's top-k order, kernels/moe.py `Experts.route`).

Recording reads the ids the layer computes anyway (`route`, then `mix`: the same operations
as `Experts.__call__`), so the batch's results are unchanged by it; a forward without a
recorder never looks.
"""

from __future__ import annotations

import torch

from shoal.kernels.moe import Experts


class ExpertRecorder:
    """Collects each MoE layer's top-k ids at `places` [M] (int64, rows of the batch), one
    layer at a time, on the batch's device; `ids` stacks them once every layer ran."""

    def __init__(self, places: torch.Tensor, num_layers: int, top_k: int) -> None:
        assert places.dim() == 1, places.shape
        self.places = places
        self.num_layers = num_layers
        self.top_k = top_k
        self.layers: dict[int, torch.Tensor] = {}  # layer -> int32 [M, top_k]

    def record(self, layer: int, top_experts: torch.Tensor) -> None:
        """Layer `layer`'s (the model's numbering) ids [T, top_k] for the whole batch."""
        assert 0 <= layer < self.num_layers and layer not in self.layers, layer
        assert top_experts.shape[1] == self.top_k, (top_experts.shape, self.top_k)
        self.layers[layer] = top_experts[self.places].to(torch.int32)

    def run(self, experts: Experts, x: torch.Tensor, layer: int) -> torch.Tensor:
        """`experts(x)` of the model's layer `layer`, its ids recorded: the same operations
        as `Experts.__call__` (route, then mix), so the same result."""
        top_weights, top_experts = experts.route(x)
        self.record(layer, top_experts)
        return experts.mix(x, top_weights, top_experts)

    def ids(self) -> torch.Tensor:
        """int32 [M, num_layers, top_k]: the recorded layers' ids, 0 for the others."""
        num_places = int(self.places.shape[0])
        out = torch.zeros(
            num_places, self.num_layers, self.top_k, dtype=torch.int32, device=self.places.device
        )
        for layer, ids in self.layers.items():
            out[:, layer] = ids
        return out


Recorder = ExpertRecorder | None  # a forward's: None records nothing
