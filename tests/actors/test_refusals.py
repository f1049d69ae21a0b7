"""Typed failures across the actors' seams (actors/replies.py): an operation's reply succeeds
or raises an OperationRefused with a code (results.py, RefusalCode), never answers "why not"
as text; the public input and result types live in public modules; the tests' hooks are one
namespace (`engine.testing`)."""

from __future__ import annotations

import asyncio
import typing
from functools import partial
from pathlib import Path

import pytest
from engines import EngineFactory

import shoal
from shoal.actors.cache_manager.cache_manager import CacheManager
from shoal.actors.executor_messages import LoadWeights
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import CacheMsg, CheckIntegrity, FlushWhenIdle, SchedulerMsg, Shutdown
from shoal.actors.replies import ask
from shoal.actors.writer_messages import DiskWeights, UpdateWeights
from shoal.api.engine import Engine
from shoal.cache.kv import KVCache
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.models.load import LoadedModel
from shoal.params import Bootstrap
from shoal.results import OperationRefused, UpdateResult

PROMPT = [5, 17, 42, 99, 7, 3]


async def test_a_flush_that_finds_no_idle_moment_raises_engine_busy(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine()
    engine.testing.hold()
    stream = engine.generate(input_ids=PROMPT, max_new_tokens=4, ignore_eos=True)
    assert await engine.testing.advance() is not None  # a batch in flight: never idle
    flush = partial(FlushWhenIdle, 10**6, 0.01)
    with pytest.raises(OperationRefused, match="did not become idle") as refused:
        await ask(engine.actors.tokenizer_box, flush)
    assert refused.value.code == "engine_busy"
    engine.testing.release()
    await stream.result()
    assert await ask(engine.actors.tokenizer_box, partial(FlushWhenIdle, 10**6 + 1, 5.0)) is None


async def test_a_refused_checkpoint_raises_invalid_checkpoint_and_the_update_says_why(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    engine = await make_engine()
    with pytest.raises(OperationRefused) as refused:
        await ask(engine.actors.executor_box, partial(LoadWeights, DiskWeights(str(tmp_path))))
    assert refused.value.code == "invalid_checkpoint"
    update = partial(UpdateWeights, DiskWeights(str(tmp_path)), False, None)
    result = await ask(engine.actors.tokenizer_box, update)  # the one update result type
    assert isinstance(result, UpdateResult) and not result.success
    assert result.message == str(refused.value) and result.weight_version == "0"
    assert await engine.update_weights_from_disk(tmp_path) == result


async def test_an_integrity_violation_is_a_typed_refusal() -> None:
    kv = KVCache(num_pages=8, page_size=4, num_rows=2, max_pages_per_row=4)
    assert kv.admit("leaked", [1, 2, 3], 4) is not None  # a row held while "idle"
    box: Mailbox[CacheMsg] = Mailbox("cache")
    manager = CacheManager(kv, box, Mailbox[SchedulerMsg]("scheduler"), strict=False)
    task = asyncio.create_task(manager.run())
    with pytest.raises(OperationRefused, match="leaked rows") as refused:
        await ask(box, CheckIntegrity)
    assert refused.value.code == "integrity_violation"
    box.put(Shutdown())
    await task


def test_public_types_and_the_testing_namespace() -> None:
    hints = typing.get_type_hints(Engine.generate)
    assert hints["bootstrap"] == Bootstrap | None and Bootstrap.__module__ == "shoal.params"
    assert typing.get_type_hints(Engine.update_weights_from_disk)["return"] is UpdateResult
    assert shoal.Bootstrap is Bootstrap and shoal.UpdateResult is UpdateResult
    testing = Engine().testing
    for hook in ("hold", "release", "advance", "deliver", "faults", "stages"):
        assert not hasattr(Engine, hook) and hook in dir(testing), hook


def test_the_loaded_tokenizer_fits_the_protocol(tiny_model: LoadedModel) -> None:
    assert isinstance(tiny_model.tokenizer, HFTokenizer)
    text = "Hello there"
    ids = tiny_model.tokenizer.encode(text, add_special_tokens=False)
    assert tiny_model.tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": text}]
    rendered = tiny_model.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str) and text in rendered
    assert isinstance(tiny_model.tokenizer.convert_ids_to_tokens(ids[0]), str)
