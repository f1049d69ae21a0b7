"""The routed experts a recording forward gives (kernels/routed_experts.py) are the top-k of
transformers' own router at every recorded position and MoE layer, on the tiny Mixtral and
Qwen3-MoE (whose layer 1 is dense: its row is 0); chunked (a prefill in two batches over the
KV the first stored) as whole; and recording leaves the logits bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_families import make_family_folder

from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import BatchShape
from shoal.kernels.routed_experts import ExpertRecorder
from shoal.models.kv_pool import KVPool
from shoal.models.load import LoadedModel, load_model
from shoal.models.registry import family_of

LENGTH = 24


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    return make_family_folder(tmp_path_factory.mktemp(name), name)


def _oracle(
    folder: Path, ids: list[int], sparse_layers: tuple[bool, ...], top_k: int
) -> torch.Tensor:
    """transformers' top-k of each MoE layer's router softmax (`output_router_logits`: one
    [T, E] a sparse layer, in layer order): int32 [T, num_layers, top_k], 0 for a dense layer."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        router_logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    numbers = [n for n, sparse in enumerate(sparse_layers) if sparse]
    assert len(router_logits) == len(numbers) > 0
    out = torch.zeros(len(ids), len(sparse_layers), top_k, dtype=torch.int32)
    for number, logits in zip(numbers, router_logits, strict=True):
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out[:, number] = probs.topk(top_k, dim=-1).indices.to(torch.int32)
    return out


def _prefill(
    loaded: LoadedModel, ids: list[int], cuts: list[int], record: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt through the model in chunks ending at `cuts`: the last chunk's last logits,
    and (record) every position's routed experts, each chunk's recorded on its own."""
    config, cpu = loaded.config, torch.device("cpu")
    model = family_of(config.model_type).build(config, loaded.weights, torch.float32, cpu)
    assert config.moe is not None
    pool = KVPool(config, 64, torch.float32, cpu)
    table = torch.arange(64).view(1, 64)
    parts: list[torch.Tensor] = []
    start = 0
    logits = torch.empty(0)
    for end in cuts:
        count = end - start
        shape = BatchShape((0,), (start,), (count,))
        attention = TorchAttention(1).prepare(table, shape)
        recorder = None
        if record:
            recorder = ExpertRecorder(torch.arange(count), config.num_layers, config.moe.top_k)
        h = model.run_layers(
            model.embed(torch.tensor(ids[start:end])),
            torch.arange(start, end),
            attention,
            pool,
            recorder,
        )
        logits = model.head(h, torch.tensor([count - 1]))
        if recorder is not None:
            parts.append(recorder.ids())
        start = end
    return logits, torch.cat(parts) if parts else None


def test_recorded_experts_are_transformers_router_top_k(moe_folder: Path) -> None:
    loaded = load_model(moe_folder, progress=False)
    config = loaded.config
    assert config.moe is not None
    ids = torch.randint(3, config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(1))
    prompt = ids.tolist()
    expected = _oracle(moe_folder, prompt, config.moe.sparse_layers, config.moe.top_k)
    _, whole = _prefill(loaded, prompt, [LENGTH], record=True)
    _, chunked = _prefill(loaded, prompt, [5, 6, 17, LENGTH], record=True)
    assert whole is not None and chunked is not None
    assert whole.dtype == torch.int32 and whole.shape == expected.shape
    assert torch.equal(whole, expected)
    assert torch.equal(chunked, expected)
    for layer, sparse in enumerate(config.moe.sparse_layers):
        assert bool(whole[:, layer].any()) == sparse  # a dense layer's row stays 0


def test_recording_leaves_the_logits_bit_identical(moe_folder: Path) -> None:
    loaded = load_model(moe_folder, progress=False)
    prompt = list(range(3, 3 + LENGTH))
    plain, _ = _prefill(loaded, prompt, [9, LENGTH], record=False)
    recorded, _ = _prefill(loaded, prompt, [9, LENGTH], record=True)
    assert torch.equal(plain, recorded)


def test_recorder_keeps_only_its_places() -> None:
    recorder = ExpertRecorder(torch.tensor([2, 0]), num_layers=3, top_k=2)
    recorder.record(1, torch.tensor([[1, 0], [3, 2], [0, 3]]))
    assert recorder.ids().tolist() == [[[0, 0], [0, 3], [0, 0]], [[0, 0], [1, 0], [0, 0]]]
