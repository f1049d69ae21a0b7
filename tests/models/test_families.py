"""Every model family shoal serves: greedy tokens equal transformers' `generate` on a tiny random
model of that family (tests/support/tiny_families.py), under batching, chunked prefill, prefix hits,
page sizes 1 and 16, a session, a weight update between two checkpoints, and speculative
decoding's drafts.

Windowed families (Mistral, Qwen3's upper layers, Gemma 2 and 3, Phi-3) have a window of 16
tokens here, so the prompts (up to 100 tokens, and a session's history past 150) are several
windows long.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from engines import EngineFactory
from parity import copying_prompts, mixed_prompts
from reference import Reference
from served import ServeFactory
from tiny_families import FAMILIES, WINDOW, make_family_folder

from shoal.models.load import LoadedModel, load_model
from shoal.models.registry import family_of, supported_model_types

NEW_TOKENS = 12


@dataclass
class Case:
    name: str
    folder: Path
    loaded: LoadedModel
    reference: Reference


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name = request.param
    folder = make_family_folder(tmp_path_factory.mktemp(name), name)
    loaded = load_model(folder, progress=False)
    return Case(name, folder, loaded, Reference(folder, loaded.config.eos_token_ids))


async def greedy_all(engine, prompts: list[list[int]]) -> list:
    streams = [
        engine.generate(input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0.0) for p in prompts
    ]
    return await asyncio.gather(*(s.result() for s in streams))


@pytest.mark.parametrize("page_size", [1, 16])
async def test_greedy_tokens_equal_transformers(
    make_engine: EngineFactory, case: Case, page_size: int
) -> None:
    engine = await make_engine(case.loaded, page_size=page_size, chunk_size=7)
    prompts = mixed_prompts(case.loaded.config.vocab_size)
    expected = [case.reference.greedy(p, NEW_TOKENS) for p in prompts]
    done = await greedy_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expected
    # A second wave hits the prefix cache and still gives the same tokens.
    again = await greedy_all(engine, prompts)
    assert [list(d.token_ids) for d in again] == expected
    assert all(
        d.usage.cached_tokens > 0 for d, p in zip(again, prompts, strict=True) if len(p) > 17
    )


@pytest.mark.usefixtures("eager_drafts")  # drafts at every match (conftest.py)
async def test_greedy_tokens_with_drafts_equal_transformers(
    make_engine: EngineFactory, case: Case
) -> None:
    """Speculative decoding: drafts verified in one step over the paged KV (a windowed
    family's window included) keep transformers' greedy tokens."""
    engine = await make_engine(case.loaded, page_size=4, speculative_algorithm="ngram")
    prompts = copying_prompts(case.loaded.config.vocab_size)
    new = 2 * NEW_TOKENS
    expected = [case.reference.greedy(p, new) for p in prompts]
    streams = [engine.generate(input_ids=p, max_new_tokens=new, temperature=0.0) for p in prompts]
    done = await asyncio.gather(*(s.result() for s in streams))
    assert [list(d.token_ids) for d in done] == expected
    assert (await engine.snapshot()).spec_steps > 0


async def test_session_turns_equal_stateless_requests(
    make_engine: EngineFactory, case: Case
) -> None:
    engine = await make_engine(case.loaded, page_size=4)
    rng = random.Random(3)
    history: list[int] = []
    async with await engine.open_session() as session:
        for turn in range(8):
            new = [rng.randrange(3, 500) for _ in range(7 + 5 * turn % 11)]
            done = await session.turn(
                input_ids=new, max_new_tokens=8, temperature=0.0, ignore_eos=True
            ).result()
            expected = case.reference.greedy(history + new, 8, True)
            assert list(done.token_ids) == expected, f"turn {turn}"
            history += new + list(done.token_ids)
    assert len(history) > 150


async def test_a_weight_update_serves_the_second_checkpoint(
    make_engine: EngineFactory, case: Case, tmp_path: Path
) -> None:
    second = make_family_folder(tmp_path / "second", case.name, seed=1)
    reference = Reference(second, case.loaded.config.eos_token_ids)
    engine = await make_engine(case.loaded, page_size=4)
    prompts = mixed_prompts(case.loaded.config.vocab_size)[:4]
    before = await greedy_all(engine, prompts)
    assert [list(d.token_ids) for d in before] == [
        case.reference.greedy(p, NEW_TOKENS) for p in prompts
    ]
    result = await engine.update_weights_from_disk(second)
    assert result.success, result.message
    after = await greedy_all(engine, prompts)
    assert [list(d.token_ids) for d in after] == [reference.greedy(p, NEW_TOKENS) for p in prompts]


async def test_model_info_names_the_family_and_window(
    serve: ServeFactory,
    case: Case,
) -> None:
    s = await serve(model=case.loaded)
    config = case.loaded.config
    window = WINDOW if any(w is not None for w in config.layer_windows) else None
    if case.name in ("mistral", "qwen3", "gemma2", "gemma3", "phi3"):
        assert window == WINDOW
    async with s.http.get(s.url + "/get_model_info") as resp:
        info = await resp.json()
    family = family_of(config.model_type).name
    assert (info["family"], info["sliding_window"]) == (family, window)
    async with s.http.get(s.url + "/v1/models") as resp:
        card = (await resp.json())["data"][0]
    assert (card["family"], card["sliding_window"]) == (family, window)
    assert card["max_model_len"] == info["context_length"]


def test_the_readme_lists_every_family_and_the_refusal() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## Model families", 1)[1].split("\n\n", 3)[2]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    listed = [row.split("|")[2].strip().strip("`") for row in rows[1:]]
    assert listed == list(supported_model_types())
    with pytest.raises(ValueError) as refused:
        family_of("gpt2")
    assert str(refused.value) in readme
    assert set(FAMILIES) >= {family_of(t).name.replace("llama", "llama3") for t in listed}
