"""The engine with the Triton attention backend (run by the interpreter on CPU) gives the
same greedy tokens as transformers, through prefill, chunked prefill, prefix-cache hits and
batched decode. On CPU this is the only place the Triton batch preparation meets the model."""

from __future__ import annotations

import pytest
from engines import EngineFactory
from parity import expect, mixed_prompts, run_all
from reference import Reference

pytest.importorskip("triton", reason="the triton package is not installed")


@pytest.mark.parametrize("page_size", [1, 16])
async def test_triton_backend_greedy_matches_transformers(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int
) -> None:
    engine = await make_engine(
        attention="triton",
        dtype="float32",  # on CUDA too: the reference is float32
        page_size=page_size,
        chunk_size=32,
        kv_cache_tokens=2048,
    )
    assert engine.resolved is not None and engine.resolved.attention == "triton"
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
    again = await run_all(engine, prompts[4:])  # the shared prefix is cached now
    assert [list(d.token_ids) for d in again] == expect(tiny_reference, prompts[4:])
    assert all(d.usage.cached_tokens > 0 for d in again)


async def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        await make_engine(attention="triton", device="cpu")
