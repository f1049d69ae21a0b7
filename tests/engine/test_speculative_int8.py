"""Speculative decoding with int8 weights (issue 35): int8 takes a step of many rows in another
kernel than its blocks (kernels/int8_rows.py), and a verification of k drafts is 1 + k
positions of one row. It must take the kernel its row's one-token decode takes, so that greedy
rows give the tokens they give without drafts: a step chooses by the rows it stands for, a
verification counting as its row's one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from engines import EngineFactory
from parity import copying_prompts
from workload import greedy

from shoal.kernels import int8_gated, int8_rows, quant
from shoal.kernels.int8_rows import ManyRows
from shoal.models import decoder

pytestmark = pytest.mark.usefixtures("eager_drafts")  # drafts at every match (conftest.py)

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
NEW = 24
# Steps of this many rows take the dequantized weights (the lm_head too): fewer than a
# verification's 1 + 4 positions, more than the streams run here at once.
MANY_ROWS = 4


async def run(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts' greedy tokens, their prefills all in the first step (the same in every
    engine: a decode beside a prompt's chunk would take the many-row kernel)."""
    engine.testing.hold()
    streams = [engine.generate(input_ids=p, **greedy(NEW)) for p in prompts]
    assert await engine.testing.advance() is not None
    engine.testing.release()
    return [list(d.token_ids) for d in await asyncio.gather(*(s.result() for s in streams))]


@pytest.fixture
def other_weights_for_many_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8's dequantized weights from MANY_ROWS rows on, in float32 panels, and negated: a
    position that takes them where its decode would take the blocks shows in the tokens."""
    monkeypatch.setattr(int8_rows, "many_rows", lambda: ManyRows(MANY_ROWS, False))
    for module, name in ((quant, "pack_panels"), (int8_gated, "pack_gated_panels")):
        pack = getattr(module, name)
        monkeypatch.setattr(module, name, lambda w, pack=pack: pack(torch.neg(w)))


@pytest.mark.usefixtures("other_weights_for_many_rows")
@pytest.mark.parametrize("path", ["compiled layers", "layer loop", "two stages"])
async def test_int8_greedy_with_drafts_gives_the_tokens_without(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """One stream at a time, then three at once (steps of at most three sequences but the
    first, the prompts' prefills: the blocks in both engines but there); through the compiled
    layers (csrc/decoder_layers.cpp: a step of decodes and verifications), the layer loop, and
    two pipeline stages (the last verifies)."""
    compiled = path == "compiled layers"
    built: list[object] = []
    real = decoder.fused_layers

    def fused_layers(*args: Any) -> object:
        built.append(real(*args) if compiled else None)
        return built[-1]

    monkeypatch.setattr(decoder, "fused_layers", fused_layers)
    options: dict[str, Any] = {"page_size": 4, "quantization": "int8"}
    if path == "two stages":
        options["pipeline_stages"] = 2
    off = await make_engine(**options)
    on = await make_engine(**options, **SPEC)
    assert built and all((b is not None) == compiled for b in built)
    prompts = copying_prompts(on.loaded.config.vocab_size)
    for prompt in prompts:
        assert await run(on, [prompt]) == await run(off, [prompt])
    assert await run(on, prompts[:3]) == await run(off, prompts[:3])
    assert (await on.snapshot()).spec_steps > 0
