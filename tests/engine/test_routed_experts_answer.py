"""return_routed_experts end to end (SGLang's meaning, docs/architecture.md "Routed experts"):
the Completion's rows are transformers' router top-k at every position from
routed_experts_start_len to the last input (the prompt and the output teacher-forced), on the
tiny Mixtral and Qwen3-MoE, whatever the page size and the chunking, and after a prefix-cache
hit (the cache reuses no position asked for); asking changes no token; the refusals are the
caller's (a start past the prompt, a dense model, pipeline stages)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from engines import EngineFactory
from tiny_families import make_family_folder

from shoal import RequestError
from shoal.actors.scheduler import decode_set
from shoal.models.load import LoadedModel, load_model
from shoal.results import Completion


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    return make_family_folder(tmp_path_factory.mktemp(name), name)


@pytest.fixture(scope="module")
def moe_model(moe_folder: Path) -> LoadedModel:
    return load_model(moe_folder, progress=False)


@pytest.fixture(scope="module")
def hf_model(moe_folder: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
    return model.eval()


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def oracle(hf: torch.nn.Module, loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    """transformers' top-k of each MoE layer's router softmax at every position of `ids`:
    int32 [T, num_layers, top_k], 0 for a dense layer."""
    moe = loaded.config.moe
    assert moe is not None
    with torch.no_grad():
        router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    numbers = [n for n, sparse in enumerate(moe.sparse_layers) if sparse]
    out = torch.zeros(len(ids), len(moe.sparse_layers), moe.top_k, dtype=torch.int32)
    for number, logits in zip(numbers, router_logits, strict=True):
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out[:, number] = probs.topk(moe.top_k, dim=-1).indices.to(torch.int32)
    return out.numpy()


def rows_of(done: Completion, loaded: LoadedModel) -> np.ndarray:
    moe = loaded.config.moe
    assert done.routed_experts is not None and moe is not None
    flat = np.frombuffer(done.routed_experts, dtype="<i4")
    return flat.reshape(-1, loaded.config.num_layers, moe.top_k)


async def run(engine: object, prompt: list[int], **fields: object) -> Completion:
    fields = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, **fields}
    return await engine.generate(input_ids=prompt, **fields).result()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("page_size", "chunk_size"), [(1, 512), (16, 5)])
async def test_routed_experts_are_the_routers_at_every_position(
    make_engine: EngineFactory,
    moe_model: LoadedModel,
    hf_model: torch.nn.Module,
    page_size: int,
    chunk_size: int,
) -> None:
    engine = await make_engine(moe_model, page_size=page_size, chunk_size=chunk_size)
    prompt = prompt_ids(21, 4)
    plain = await run(engine, prompt)
    assert plain.routed_experts is None
    done = await run(engine, prompt, return_routed_experts=True)
    assert done.token_ids == plain.token_ids  # asking changes no token
    tokens = prompt + list(done.token_ids)
    expected = oracle(hf_model, moe_model, tokens)
    got = rows_of(done, moe_model)
    assert got.shape == (len(tokens) - 1, *expected.shape[1:])
    np.testing.assert_array_equal(got, expected[: len(tokens) - 1])
    # the same again: the prefix cache holds the prompt, yet every position is computed
    again = await run(engine, prompt, return_routed_experts=True)
    assert again.usage.cached_tokens == 0
    assert again.routed_experts == done.routed_experts
    # from a start: the rows from there on, the cache reused only before it
    start = 9
    late = await run(engine, prompt, return_routed_experts=True, routed_experts_start_len=start)
    assert late.token_ids == plain.token_ids
    assert 0 < late.usage.cached_tokens <= start or page_size == 16
    assert late.usage.cached_tokens <= start
    np.testing.assert_array_equal(rows_of(late, moe_model), expected[start : len(tokens) - 1])
    # from the prompt's end: the output's inputs only
    end = await run(engine, prompt, return_routed_experts=True, routed_experts_start_len=21)
    np.testing.assert_array_equal(rows_of(end, moe_model), expected[21 : len(tokens) - 1])


async def test_a_batch_mixes_asking_and_plain_requests(
    make_engine: EngineFactory,
    moe_model: LoadedModel,
    hf_model: torch.nn.Module,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steady steps (a decode set) could form from one running request: one that asks keeps
    the per-request code, so every one of its rows comes back."""
    monkeypatch.setattr(decode_set, "MIN_MEMBERS", 1)
    engine = await make_engine(moe_model, page_size=4, chunk_size=7)
    prompts = [prompt_ids(13 + i, 10 + i) for i in range(4)]
    alone = [await run(engine, p) for p in prompts]
    streams = [
        engine.generate(
            input_ids=p,
            max_new_tokens=6,
            temperature=0.0,
            ignore_eos=True,
            return_routed_experts=i % 2 == 0,
            routed_experts_start_len=i,
        )
        for i, p in enumerate(prompts)
    ]
    done = [await s.result() for s in streams]
    for i, (prompt, one, mixed) in enumerate(zip(prompts, alone, done, strict=True)):
        assert mixed.token_ids == one.token_ids
        if i % 2:
            assert mixed.routed_experts is None
            continue
        tokens = prompt + list(mixed.token_ids)
        expected = oracle(hf_model, moe_model, tokens)[i : len(tokens) - 1]
        np.testing.assert_array_equal(rows_of(mixed, moe_model), expected)


async def test_prefill_alone_answers_the_prompts_rows(
    make_engine: EngineFactory, moe_model: LoadedModel, hf_model: torch.nn.Module
) -> None:
    engine = await make_engine(moe_model)
    prompt = prompt_ids(11, 7)
    done = await run(engine, prompt, max_new_tokens=0, return_routed_experts=True)
    np.testing.assert_array_equal(
        rows_of(done, moe_model), oracle(hf_model, moe_model, prompt)[:10]
    )


async def test_the_callers_mistakes_are_refused(
    make_engine: EngineFactory, moe_model: LoadedModel
) -> None:
    engine = await make_engine(moe_model)
    prompt = prompt_ids(8, 1)
    with pytest.raises(RequestError, match="routed_experts_start_len") as info:
        await run(engine, prompt, return_routed_experts=True, routed_experts_start_len=9)
    assert info.value.field == "routed_experts_start_len"
    with pytest.raises(RequestError, match="routed_experts_start_len"):
        await run(engine, prompt, return_routed_experts=True, routed_experts_start_len=-1)
    # not asked: the start is not read past the prompt (as SGLang)
    assert (await run(engine, prompt, routed_experts_start_len=9)).routed_experts is None


async def test_a_dense_model_refuses_it(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    with pytest.raises(RequestError, match="no mixture-of-experts layers") as info:
        engine.generate(input_ids=[5, 6, 7], return_routed_experts=True)
    assert info.value.field == "return_routed_experts"
