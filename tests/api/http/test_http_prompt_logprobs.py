"""Prompt logprobs at the HTTP doors: /generate's logprob_start_len, top_logprobs_num and
token_ids_logprob (SGLang's meta_info input_* lists; slime's on-policy distillation body),
/v1/completions' echo with logprobs (OpenAI's legacy shape, max_tokens 0 to score a prompt),
vLLM's prompt_logprobs on completions and chat; and their refusals. The values are the
model's, checked against transformers (tests/engine/test_prompt_logprobs.py checks the engine
at every position; here each door's shape and that it carries those values)."""

from __future__ import annotations

import math
import random
from typing import Any

import torch
from reference import Reference
from served import MODEL, ServeFactory, chat, post, post_ok, sse_events

ATOL = 1e-4


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def oracle(reference: Reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def test_generate_scores_a_sequence_as_slimes_distillation_asks(
    serve: ServeFactory, tiny_reference: Reference
) -> None:
    """slime's on-policy distillation: max_new_tokens 0, logprob_start_len 0, and it reads
    meta_info["input_token_logprobs"][1:], each item's [0]."""
    s = await serve(chunk_size=5)
    ids = prompt_ids(17, 1)
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    got = await post_ok(s, "/generate", body)
    meta = got["meta_info"]
    assert got["output_ids"] == [] and got["text"] == ""
    assert meta["completion_tokens"] == 0 and meta["finish_reason"]["type"] == "length"
    assert meta["output_token_logprobs"] == []
    rows = meta["input_token_logprobs"]
    assert rows[0] == [None, ids[0], None] and len(rows) == len(ids)
    expected = oracle(tiny_reference, ids)
    scores = [item[0] for item in rows[1:]]  # as slime reads them
    for position, (score, row) in enumerate(zip(scores, rows[1:], strict=True), start=1):
        assert row[1] == ids[position] and row[2] is None
        assert abs(score - float(expected[position - 1, ids[position]])) < ATOL


async def test_generate_reports_input_top_and_listed_ids_from_the_start(
    serve: ServeFactory, tiny_reference: Reference
) -> None:
    s = await serve()
    ids = prompt_ids(9, 2)
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 9],
    }
    plain_answer = await post_ok(s, "/generate", body)
    plain = plain_answer["meta_info"]
    assert plain["input_token_logprobs"] == [] and plain["input_top_logprobs"] == []
    assert plain["input_token_ids_logprobs"] == []  # SGLang's answer without a start
    got = await post_ok(s, "/generate", {**body, "logprob_start_len": 4})
    meta = got["meta_info"]
    expected = oracle(tiny_reference, ids + got["output_ids"])
    assert [row[1] for row in meta["input_token_logprobs"]] == ids[4:]
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_ids_logprobs"]) == 5
    for position, (top, listed) in enumerate(
        zip(meta["input_top_logprobs"], meta["input_token_ids_logprobs"], strict=True), start=4
    ):
        row = expected[position - 1]
        assert [t for _, t, _ in top] == row.topk(2).indices.tolist()
        assert [t for _, t, _ in listed] == [5, 9]
        assert all(abs(lp - float(row[t])) < ATOL for lp, t, _ in listed)
    outputs = meta["output_token_ids_logprobs"]
    assert len(outputs) == 3 and all([t for _, t, _ in step] == [5, 9] for step in outputs)
    assert got["output_ids"] == plain_answer["output_ids"]  # greedy either way
    whole = await post_ok(s, "/generate", {**body, "logprob_start_len": 0})
    assert whole["meta_info"]["input_top_logprobs"][0] is None
    assert whole["meta_info"]["input_token_ids_logprobs"][0] is None
    assert whole["output_ids"] == got["output_ids"]


async def test_generate_streams_the_prompts_logprobs_with_the_first_event(
    serve: ServeFactory,
) -> None:
    s = await serve()
    ids = prompt_ids(8, 3)
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    whole = (await post_ok(s, "/generate", body))["meta_info"]["input_token_logprobs"]
    async with s.http.post(s.url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        events = [e for e in await sse_events(resp) if e != "[DONE]"]
    assert len(events) >= 2
    for event in events:  # cumulative: every event has everything so far
        assert event["meta_info"]["input_token_logprobs"] == whole
    async with s.http.post(
        s.url + "/generate",
        json={**body, "stream": True, "sampling_params": {"max_new_tokens": 0}},
    ) as resp:
        [only] = [e for e in await sse_events(resp) if e != "[DONE]"]
    assert only["meta_info"]["input_token_logprobs"] == whole and only["output_ids"] == []
    incremental = await serve(incremental_streaming_output=True)
    async with incremental.http.post(
        incremental.url + "/generate", json={**body, "stream": True}
    ) as resp:
        events = [e for e in await sse_events(resp) if e != "[DONE]"]
    assert events[0]["meta_info"]["input_token_logprobs"] == whole  # once, with the first
    assert all("input_token_logprobs" not in e["meta_info"] for e in events[1:])


async def test_generate_refuses_what_cannot_be_answered(serve: ServeFactory) -> None:
    s = await serve(max_token_ids_logprob=2)
    base = {"input_ids": [5, 6, 7], "return_logprob": True}
    for body, param in [
        ({**base, "logprob_start_len": 3}, "logprob_start_len"),  # the prompt's length
        ({**base, "logprob_start_len": -2}, "logprob_start_len"),
        ({**base, "top_logprobs_num": 21, "logprob_start_len": 0}, "top_logprobs_num"),
        ({**base, "token_ids_logprob": [1, 2, 3]}, "token_ids_logprob"),
        ({**base, "token_ids_logprob": [10**7]}, "token_ids_logprob"),
        ({**base, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ]:
        status, got = await post(s, "/generate", body)
        assert status == 400 and got["error"]["param"] == param, (body, got)


async def test_completions_echo_scores_the_prompt(
    serve: ServeFactory, tiny_reference: Reference
) -> None:
    """OpenAI's legacy scoring: echo, logprobs, max_tokens 0: the prompt's tokens, the first
    one's logprob and top null, then (with max_tokens) the completion's."""
    s = await serve()
    text = "The sea is calm tonight"
    ids = s.engine.tokenizer.encode(text)
    body = {"model": MODEL, "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0}
    got = await post_ok(s, "/v1/completions", body)
    [choice] = got["choices"]
    assert choice["text"] == text and got["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = oracle(tiny_reference, ids)
    for position in range(1, len(ids)):
        want = float(expected[position - 1, ids[position]])
        assert abs(lp["token_logprobs"][position] - want) < ATOL
        assert len(lp["top_logprobs"][position]) <= 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    more = await post_ok(s, "/v1/completions", {**body, "max_tokens": 3, "temperature": 0})
    [choice] = more["choices"]
    generated = await s.engine.generate(text, max_new_tokens=3, temperature=0.0).result()
    assert choice["text"] == text + generated.text
    assert len(choice["logprobs"]["tokens"]) == len(ids) + len(generated.token_ids)
    assert choice["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    echoed = await post_ok(s, "/v1/completions", {**body, "max_tokens": 2, "logprobs": None})
    assert echoed["choices"][0]["text"].startswith(text)
    assert echoed["choices"][0]["logprobs"] is None
    # streamed: the prompt with the first chunk
    stream_body = {**body, "max_tokens": 2, "stream": True}
    async with s.http.post(s.url + "/v1/completions", json=stream_body) as resp:
        chunks = [e for e in await sse_events(resp) if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(text)
    assert first["logprobs"]["token_logprobs"][0] is None
    async with s.http.post(s.url + "/v1/completions", json={**body, "stream": True}) as resp:
        chunks = [e for e in await sse_events(resp) if e != "[DONE]"]
    [only] = chunks
    assert only["choices"][0]["text"] == text and only["choices"][0]["finish_reason"] == "length"


async def test_vllm_prompt_logprobs_on_completions_and_chat(
    serve: ServeFactory, tiny_reference: Reference
) -> None:
    s = await serve()
    ids = prompt_ids(10, 4)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3}
    got = await post_ok(s, "/v1/completions", body)
    [choice] = got["choices"]
    assert choice["logprobs"] is None  # the completion's were not asked for
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(ids)
    expected = oracle(tiny_reference, ids)
    for position in range(1, len(ids)):
        entry = prompt[position]
        row = expected[position - 1]
        mine = entry[str(ids[position])]
        assert abs(mine["logprob"] - float(row[ids[position]])) < ATOL
        assert mine["rank"] == int((row > row[ids[position]]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert set(entry) == {str(ids[position]), *map(str, top)}
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    zero = await post_ok(s, "/v1/completions", {**body, "prompt_logprobs": 0})
    assert all(len(e) == 1 for e in zero["choices"][0]["prompt_logprobs"][1:])
    reply = await post_ok(
        s, "/v1/chat/completions", chat("hi there", max_tokens=2, prompt_logprobs=1)
    )
    chat_prompt = reply["prompt_logprobs"]
    assert chat_prompt[0] is None and len(chat_prompt) == reply["usage"]["prompt_tokens"]
    assert all(math.isfinite(e["logprob"]) for entry in chat_prompt[1:] for e in entry.values())
    plain = await post_ok(s, "/v1/chat/completions", chat("hi there", max_tokens=2))
    assert plain.get("prompt_logprobs") is None


async def test_openai_doors_refuse_what_they_cannot_answer(serve: ServeFactory) -> None:
    s = await serve()
    completion = {"model": MODEL, "prompt": "The sea"}
    for path, body, param in [
        ("/v1/completions", {**completion, "max_tokens": 0}, "max_tokens"),  # only with echo
        ("/v1/chat/completions", chat("hi", max_tokens=0), "max_tokens"),
        ("/v1/chat/completions", chat("hi", max_completion_tokens=0), "max_completion_tokens"),
        ("/v1/completions", {**completion, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {**completion, "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            "/v1/completions",
            {**completion, "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", chat("hi", prompt_logprobs=1, stream=True), "prompt_logprobs"),
        ("/v1/chat/completions", chat("hi", echo=True), "echo"),  # chat's echo: vLLM's other
    ]:
        status, got = await post(s, path, body)
        assert status == 400 and got["error"]["param"] == param, (body, got)
