"""The OpenAI-compatible routes, driven by the real openai client (AsyncOpenAI)."""

from __future__ import annotations

import math

import openai
import pytest
from served import MODEL, Served, ServeFactory, chat, sse_events

from shoal import SamplingParams

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a fish."},
]


def single_prompt_tokens(s: Served, messages: list[dict[str, str]]) -> int:
    tokenizer = s.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


async def test_chat_greedy_equals_the_engine_and_usage_is_right(serve: ServeFactory) -> None:
    s = await serve()
    reply = await s.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    direct = await s.engine.generate(
        messages=MESSAGES, max_new_tokens=12, temperature=0.0, ignore_eos=True
    ).result()
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.id.startswith("chatcmpl-") and reply.created > 0
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == direct.text
    assert choice.finish_reason == "length" and choice.index == 0
    num_prompt = single_prompt_tokens(s, MESSAGES)
    usage = reply.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, 12)
    assert usage.total_tokens == num_prompt + 12
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0  # the first request of a fresh cache
    again = await s.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == direct.text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache served it


async def test_chat_stream_concatenates_to_the_same_text_for_the_same_seed(
    serve: ServeFactory,
) -> None:
    s = await serve()
    fields = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "temperature": 0.9}
    whole = await s.client.chat.completions.create(**fields, seed=7)  # type: ignore[call-overload]
    stream = await s.client.chat.completions.create(  # type: ignore[call-overload]
        **fields, seed=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    other = await s.client.chat.completions.create(**fields, seed=8)  # type: ignore[call-overload]
    assert other.choices[0].message.content != whole.choices[0].message.content


async def test_raw_stream_ends_with_done_and_usage_chunk_only_when_asked(
    serve: ServeFactory,
) -> None:
    s = await serve()
    body = chat("Hello", max_tokens=5, temperature=0, stream=True)
    async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1]) and all(e["usage"] is None for e in events[:-1])
    body["stream_options"] = {"include_usage": True}
    async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] <= 5
    assert "cached_tokens" in events[-2]["usage"]["prompt_tokens_details"]


async def test_n_choices_differ_and_are_reproducible(serve: ServeFactory) -> None:
    s = await serve()
    fields = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    three = await s.client.chat.completions.create(**fields, n=3, seed=11)  # type: ignore[call-overload]
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) == 3
    again = await s.client.chat.completions.create(**fields, n=3, seed=11)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == texts
    assert three.usage is not None
    assert three.usage.completion_tokens == 3 * 16  # summed over the choices
    assert three.usage.prompt_tokens == single_prompt_tokens(s, MESSAGES)  # counted once
    single = await s.client.chat.completions.create(**fields, seed=11)  # type: ignore[call-overload]
    assert single.choices[0].message.content == texts[0]  # choice 0 uses the seed as given
    stream = await s.client.chat.completions.create(  # type: ignore[call-overload]
        **fields, n=3, seed=11, stream=True
    )
    streamed = ["", "", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


async def test_completions_take_strings_lists_and_token_ids(serve: ServeFactory) -> None:
    s = await serve()
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    one = await s.client.completions.create(prompt="The sea is", **greedy)  # type: ignore[call-overload]
    direct = await s.engine.generate(
        "The sea is", max_new_tokens=8, temperature=0.0, ignore_eos=True
    ).result()
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    assert one.choices[0].text == direct.text and one.choices[0].finish_reason == "length"
    assert one.usage is not None
    assert one.usage.prompt_tokens == direct.usage.prompt_tokens
    assert one.usage.completion_tokens == 8
    ids = s.engine.tokenizer.encode("The sea is")
    by_ids = await s.client.completions.create(prompt=ids, **greedy)  # type: ignore[call-overload]
    assert by_ids.choices[0].text == direct.text
    many = await s.client.completions.create(  # type: ignore[call-overload]
        prompt=["The sea is", "Once upon"], n=2, **greedy
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == direct.text
    other = await s.engine.generate(
        "Once upon", max_new_tokens=8, temperature=0.0, ignore_eos=True
    ).result()
    assert many.choices[2].text == other.text
    assert many.usage is not None
    assert many.usage.prompt_tokens == direct.usage.prompt_tokens + other.usage.prompt_tokens
    assert many.usage.completion_tokens == 32
    nested = await s.client.completions.create(  # type: ignore[call-overload]
        prompt=[ids, s.engine.tokenizer.encode("Once upon")], **greedy
    )
    assert [c.text for c in nested.choices] == [direct.text, other.text]
    stream = await s.client.completions.create(prompt="The sea is", stream=True, **greedy)  # type: ignore[call-overload]
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_stop_strings_and_stop_token_ids(serve: ServeFactory) -> None:
    s = await serve()
    greedy = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = await s.client.completions.create(prompt="The quick", max_tokens=30, **greedy)  # type: ignore[call-overload]
    text = full.choices[0].text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    cut = await s.client.completions.create(  # type: ignore[call-overload]
        prompt="The quick", max_tokens=30, stop=stop, **greedy
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    listed = await s.client.completions.create(  # type: ignore[call-overload]
        prompt="The quick", max_tokens=30, stop=["zzzz", stop], **greedy
    )
    assert listed.choices[0].text == cut.choices[0].text
    for keep in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):  # vLLM, SGLang
        body = {**greedy, "extra_body": {"ignore_eos": True, **keep}}
        kept = await s.client.completions.create(  # type: ignore[call-overload]
            prompt="The quick", max_tokens=30, stop=stop, **body
        )
        assert kept.choices[0].text == text[: text.index(stop)] + stop, keep
        assert kept.choices[0].finish_reason == "stop"
        streamed = await s.client.completions.create(  # type: ignore[call-overload]
            prompt="The quick", max_tokens=30, stop=stop, stream=True, **body
        )
        pieces = [c.choices[0].text async for c in streamed if c.choices]
        assert "".join(pieces) == kept.choices[0].text
    both = {"include_stop_str_in_output": True, "no_stop_trim": False}
    with pytest.raises(openai.BadRequestError, match="disagree"):
        await s.client.completions.create(  # type: ignore[call-overload]
            prompt="The quick", max_tokens=3, stop=stop, model=MODEL, extra_body=both
        )
    direct = await s.engine.generate(
        "The quick", max_new_tokens=30, temperature=0.0, ignore_eos=True
    ).result()
    token = direct.token_ids[3]
    by_token = await s.client.completions.create(  # type: ignore[call-overload]
        prompt="The quick",
        max_tokens=30,
        model=MODEL,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [token]},
    )
    assert by_token.choices[0].finish_reason == "stop"
    assert by_token.usage is not None
    assert by_token.usage.completion_tokens == direct.token_ids.index(token) + 1


async def test_extras_reach_the_sampler(serve: ServeFactory) -> None:
    s = await serve()
    fields = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.3,
        "ignore_eos": True,
        "min_tokens": 4,
    }
    reply = await s.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        user="someone",
        extra_body=fields,
    )
    sampling = SamplingParams(
        max_new_tokens=10,
        min_new_tokens=4,
        temperature=0.8,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=5,
        ignore_eos=True,
    )
    direct = await s.engine.generate(messages=MESSAGES, sampling=sampling).result()
    assert reply.choices[0].message.content == direct.text


async def test_logprobs_in_both_shapes(serve: ServeFactory) -> None:
    s = await serve()
    reply = await s.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for item in logprobs.content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.bytes is not None
        # greedy: the chosen token is the most likely one
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)
    joined = b"".join(bytes(item.bytes or []) for item in logprobs.content)
    assert joined.decode("utf-8", errors="replace") == reply.choices[0].message.content
    plain = await s.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert plain.choices[0].logprobs is None
    text = await s.client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=5, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == 5
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    stream = await s.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        item.logprob
        async for chunk in stream
        for choice in chunk.choices
        for item in (choice.logprobs.content or [] if choice.logprobs else [])
    ]
    expected = [item.logprob for item in logprobs.content]
    assert len(streamed) == len(expected)  # values: equal up to the prefix-cache path's rounding
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(streamed, expected, strict=True))


async def test_models_route_lists_the_served_name_once_and_never_the_path(
    serve: ServeFactory,
) -> None:
    s = await serve()
    assert s.engine.loaded is not None
    path = str(s.engine.loaded.path)
    models = await s.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with s.http.get(s.url + "/v1/models") as resp:
        assert path not in await resp.text()  # neither as an id nor as the card's root
    named = await s.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert named.model == MODEL
    for other in (path, s.engine.loaded.path.name):  # the folder is served as "tiny" here
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await s.client.chat.completions.create(model=other, messages=MESSAGES, max_tokens=2)
