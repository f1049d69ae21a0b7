"""The layers chained in C++ for decode-only steps (models/fused_layers.py,
csrc/decoder_layers.cpp) against the Python forward over the same kernels: the same bits in the
logits and in every cache slot, for float32, int8 and bfloat16 weights, a qkv bias, pipeline
parts and a weight update; which models and steps it takes; and that a bad step raises instead
of reading stray memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import EngineFactory
from parity import expect, mixed_prompts, run_all
from reference import Reference
from tiny_families import make_family_folder

from shoal.kernels import int8_rows
from shoal.kernels import linear as linear_module
from shoal.kernels.attention import AttentionMetadata, TorchAttention
from shoal.kernels.batch import BatchShape
from shoal.kernels.bf16_linear import onednn_bf16_available
from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.elementwise import CompiledElementwise
from shoal.kernels.int8_rows import MANY_ROWS_TILES, ManyRows
from shoal.kernels.linear import LinearKind, onednn_product
from shoal.models.decoder import DecoderModel
from shoal.models.fused_layers import FusedLayers
from shoal.models.kv_pool import KVPool
from shoal.models.layout import Part
from shoal.models.load import LoadedModel, load_model
from shoal.models.registry import family_of

PAGE = 4
NUM_PAGES = 256
# One, three, seven and twelve sequences: seven rows are a whole tile of six in the float32
# kernel and one left over; twelve reach int8's float32 panels (from MANY_ROWS_TILES rows on,
# below).
LENS = [[5], [1, 17, 9], [3, 30, 12, 7, 64, 2, 41], [4, 9, 33, 1, 2, 18, 25, 6, 11, 3, 40, 7]]
assert len(LENS[2]) < MANY_ROWS_TILES <= len(LENS[3])


@pytest.fixture(autouse=True)
def int8_panels_from_ten_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 linears take their dequantized weights from MANY_ROWS_TILES rows on whatever this
    CPU's own threshold (int8_rows.many_rows; its blocks may take every step here), so that twelve
    sequences reach them in the chain."""
    form = int8_rows.many_rows()
    monkeypatch.setattr(int8_rows, "many_rows", lambda: ManyRows(MANY_ROWS_TILES, form.bf16))


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LoadedModel]]:
    root = tmp_path_factory.mktemp("fused-families")
    yield {
        name: load_model(make_family_folder(Path(root) / name, name), progress=False)
        for name in ("llama3", "qwen2", "qwen3", "mistral", "mixtral")
    }


def build(
    loaded: LoadedModel, kernels: CpuKernels, kind: LinearKind, part: Part | None = None
) -> DecoderModel:
    family = family_of(loaded.config.model_type)
    return family.build(
        loaded.config, loaded.weights, torch.float32, torch.device("cpu"), kind,
        CompiledElementwise(kernels), part=part,
    )  # fmt: skip


def decode_step(
    kernels: CpuKernels, lens: list[int], seed: int, *, extend_first: int = 1
) -> tuple[BatchShape, torch.Tensor, AttentionMetadata]:
    """Sequences of `lens` cached tokens on random pages, each decoding one token (the first
    bringing `extend_first` tokens instead)."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-(max(lens) + extend_first) // PAGE)
    table = torch.randperm(NUM_PAGES, generator=gen)[: len(lens) * pages].view(len(lens), pages)
    extend = (extend_first,) + (1,) * (len(lens) - 1)
    shape = BatchShape(tuple(range(len(lens))), tuple(lens), extend)
    backend = TorchAttention(PAGE, kernels.paged_decode, kernels.store_kv)
    return shape, table, backend.prepare(table, shape)


def filled_pool(loaded: LoadedModel, layers: int, seed: int) -> KVPool:
    pool = KVPool(loaded.config, NUM_PAGES * PAGE, torch.float32, torch.device("cpu"), layers)
    gen = torch.Generator().manual_seed(seed)
    for cache in (*pool.k, *pool.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return pool


def copy_of(pool: KVPool) -> KVPool:
    twin = object.__new__(KVPool)
    twin.k = [t.clone() for t in pool.k]
    twin.v = [t.clone() for t in pool.v]
    twin.num_slots = pool.num_slots
    return twin


def inputs(shape: BatchShape, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (shape.num_tokens,), generator=gen)
    positions = torch.cat(
        [torch.arange(p, p + n) for p, n in zip(shape.prefix_lens, shape.extend_lens, strict=True)]
    )
    return ids, positions


def both_ways(
    model: DecoderModel, loaded: LoadedModel, kernels: CpuKernels, lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, KVPool, KVPool]:
    """The step's logits and caches through the C++ layers, then through the Python forward."""
    shape, _, meta = decode_step(kernels, lens, seed)
    ids, positions = inputs(shape, loaded.config.vocab_size, seed)
    pool = filled_pool(loaded, len(model.weights.layers), seed)
    python_pool = copy_of(pool)
    sample = torch.arange(shape.num_tokens)
    fused = model.fused
    assert fused is not None and fused.takes(meta, shape.num_tokens)
    chained = model.forward(ids, positions, meta, pool, sample)
    model.fused = None
    try:
        _, _, meta = decode_step(kernels, lens, seed)  # fresh: nothing cached from the first
        python = model.forward(ids, positions, meta, python_pool, sample)
    finally:
        model.fused = fused
    return chained, python, pool, python_pool


def assert_same_caches(a: KVPool, b: KVPool) -> None:
    for x, y in zip([*a.k, *a.v], [*b.k, *b.v], strict=True):
        assert torch.equal(x, y)


# bf16: bfloat16 weights through oneDNN, where the CPU has its bfloat16 matmul
BF16 = pytest.param(
    "bf16",
    marks=pytest.mark.skipif(
        not onednn_bf16_available(), reason="oneDNN has no bfloat16 matmul on this CPU"
    ),
)


@pytest.mark.parametrize("kind", ["packed", "int8", BF16])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])  # qwen2: a bias on qkv
@pytest.mark.parametrize("lens", LENS)
def test_a_decode_step_gives_the_python_forwards_bits(
    kernels: CpuKernels,
    families: dict[str, LoadedModel],
    kind: LinearKind,
    family: str,
    lens: list[int],
) -> None:
    loaded = families[family]
    model = build(loaded, kernels, kind)
    chained, python, pool, python_pool = both_ways(model, loaded, kernels, lens, seed=len(lens))
    assert torch.equal(chained, python)
    assert_same_caches(pool, python_pool)


def test_pipeline_parts_each_give_the_python_forwards_bits(
    kernels: CpuKernels, families: dict[str, LoadedModel]
) -> None:
    loaded = families["llama3"]
    layers = loaded.config.num_layers
    parts = [Part(range(0, 1), True, False), Part(range(1, layers), False, True)]
    shape, _, meta = decode_step(kernels, [6, 13], seed=3)
    ids, positions = inputs(shape, loaded.config.vocab_size, seed=3)
    results = []
    for use_fused in (True, False):
        h = None
        pools = []
        for part in parts:
            model = build(loaded, kernels, "packed", part)
            assert model.fused is not None
            if not use_fused:
                model.fused = None
            pool = filled_pool(loaded, len(part.layers), seed=part.layers.start)
            _, _, meta = decode_step(kernels, [6, 13], seed=3)
            h = model.run_layers(model.embed(ids) if h is None else h, positions, meta, pool)
            pools.append(pool)
        results.append((h, pools))
    (h_fused, pools_fused), (h_python, pools_python) = results
    assert h_fused is not None and torch.equal(h_fused, h_python)
    for a, b in zip(pools_fused, pools_python, strict=True):
        assert_same_caches(a, b)


@pytest.mark.parametrize("kind", ["packed", "int8", BF16])
def test_a_weight_update_rebuilds_the_chain(
    kernels: CpuKernels, families: dict[str, LoadedModel], kind: LinearKind
) -> None:
    loaded = families["llama3"]
    model = build(loaded, kernels, kind)
    before, _, _, _ = both_ways(model, loaded, kernels, [4, 9], seed=1)
    gen = torch.Generator().manual_seed(7)
    model.load({name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in
                loaded.weights.items()})  # fmt: skip
    chained, python, pool, python_pool = both_ways(model, loaded, kernels, [4, 9], seed=1)
    assert torch.equal(chained, python)
    assert_same_caches(pool, python_pool)
    assert not torch.equal(chained, before)


def test_steps_with_a_prompt_chunk_take_the_python_forward(
    kernels: CpuKernels, families: dict[str, LoadedModel]
) -> None:
    model = build(families["llama3"], kernels, "packed")
    assert model.fused is not None
    shape, _, meta = decode_step(kernels, [0, 5], seed=0, extend_first=6)
    assert not model.fused.takes(meta, shape.num_tokens)
    shape, table, _ = decode_step(kernels, [3, 5], seed=0)
    reference = TorchAttention(PAGE).prepare(table, shape)  # gathers: no decode kernel
    assert not model.fused.takes(reference, shape.num_tokens)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])  # qwen2: a bias on qkv
def test_steps_of_the_rows_float32_gives_onednn_take_the_python_forward(
    kernels: CpuKernels,
    families: dict[str, LoadedModel],
    family: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a start chose oneDNN for float32's steps of many rows (kernels/f32_many_rows.py),
    the C++ layers, which multiply on the panels, take only the steps below that; the Python
    forward's logits there are oneDNN's, close to the panels', and a weight update keeps the
    choice."""
    loaded = families[family]
    lens = LENS[3]  # twelve decodes
    model = family_of(loaded.config.model_type).build(
        loaded.config, loaded.weights, torch.float32, torch.device("cpu"), "packed",
        CompiledElementwise(kernels), f32_many_rows=len(lens),
    )  # fmt: skip
    panels = build(loaded, kernels, "packed")
    assert model.fused is not None and model.fused.python_from == len(lens)
    shape, _, meta = decode_step(kernels, lens, seed=4)
    assert not model.fused.takes(meta, shape.num_tokens)
    assert model.fused.takes(meta, shape.num_tokens, rows=len(lens) - 1)
    ids, positions = inputs(shape, loaded.config.vocab_size, seed=4)
    sample = torch.arange(shape.num_tokens)
    pool = filled_pool(loaded, loaded.config.num_layers, 4)
    panels_pool = copy_of(pool)
    onednn_calls: list[int] = []

    def counted(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        onednn_calls.append(int(x.shape[0]))
        return onednn_product(x, packed, bias)

    monkeypatch.setattr(linear_module, "onednn_product", counted)
    logits = model.forward(ids, positions, meta, pool, sample)
    layers = loaded.config.num_layers
    assert onednn_calls == [len(lens)] * 4 * layers  # qkv, o, gate_up, down of every layer
    _, _, meta = decode_step(kernels, lens, seed=4)
    expected = panels.forward(ids, positions, meta, panels_pool, sample)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    onednn_calls.clear()
    chained, python, _, _ = both_ways(model, loaded, kernels, LENS[2], seed=5)  # seven rows
    assert torch.equal(chained, python) and not onednn_calls
    model.load(dict(loaded.weights))  # a weight update: the same choice, not measured again
    assert model.f32_many_rows == len(lens) and model.fused is not None
    assert model.fused.python_from == len(lens)


@pytest.mark.parametrize(
    ("family", "kind", "elementwise"),
    [
        ("llama3", "dense", True),  # F.linear's weights: no compiled form
        ("llama3", "packed", False),  # torch's element-wise ops
        ("qwen3", "packed", True),  # q/k norms
        ("mistral", "packed", True),  # a sliding window
        ("mixtral", "packed", True),  # experts
    ],
)
def test_models_without_a_compiled_form_are_not_chained(
    kernels: CpuKernels,
    families: dict[str, LoadedModel],
    family: str,
    kind: LinearKind,
    elementwise: bool,
) -> None:
    loaded = families[family]
    model = family_of(loaded.config.model_type).build(
        loaded.config, loaded.weights, torch.float32, torch.device("cpu"), kind,
        CompiledElementwise(kernels) if elementwise else None,
    )  # fmt: skip
    assert model.fused is None


def test_a_bad_step_raises(kernels: CpuKernels, families: dict[str, LoadedModel]) -> None:
    loaded = families["llama3"]
    model = build(loaded, kernels, "packed")
    fused = model.fused
    assert fused is not None
    shape, _, meta = decode_step(kernels, [4, 9], seed=2)
    ids, positions = inputs(shape, loaded.config.vocab_size, seed=2)
    pool = filled_pool(loaded, loaded.config.num_layers, seed=2)
    cos, sin = (table[positions] for table in model.tables[0])
    assert meta.kernel_decodes is not None
    h = model.embed(ids)
    with pytest.raises(RuntimeError, match="every token of the step must be a decode"):
        fused(torch.cat([h, h]), torch.cat([cos, cos]), torch.cat([sin, sin]), meta, pool)
    bad = meta.kernel_decodes.page_ids.clone()
    bad[0, 0] = NUM_PAGES + 5
    broken = AttentionMetadata(
        meta.slot_mapping, PAGE, (), (),
        type(meta.kernel_decodes)(
            meta.kernel_decodes.kernel, meta.kernel_decodes.token_index, bad,
            meta.kernel_decodes.seq_lens,
        ),
        meta.store_kernel,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="page id out of range"):
        fused(h, cos, sin, broken, pool)


async def test_the_engine_decodes_through_the_chain(
    make_engine: EngineFactory, tiny_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU engine's default (float32, `attention="cpu"`) takes the chain for its decode
    steps and still gives transformers' greedy tokens."""
    calls = []
    chain = FusedLayers.__call__

    def counted(self: FusedLayers, *args: object) -> torch.Tensor:
        calls.append(1)
        return chain(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedLayers, "__call__", counted)
    engine = await make_engine(page_size=4)
    assert engine.attention == "cpu"
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
    assert len(calls) >= 10
