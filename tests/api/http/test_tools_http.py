"""Tools and reasoning at the chat door (issue 34, items 4 and 5), with the unchanged openai
client: a named and a "required" tool_choice (enforced by a grammar, so even the tiny random
model calls correctly), "auto" calls read by the tool-call parser (the tiny model made to write
one by an ebnf), streamed as tool-call deltas; assistant tool_calls, tool messages, tools and
chat_template_kwargs rendered by the chat template; a <think> block split off as
reasoning_content by --reasoning-parser."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from admitted import Admitted
from served import MODEL, ServeFactory, post

from shoal.models.load import LoadedModel

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Oslo", "Rome", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
# A Qwen-like template that shows tools, renders calls and tool results, and reads a variable
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function.name }} {{ call.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_a_named_tool_choice_calls_it(serve: ServeFactory) -> None:
    s = await serve()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        answer = await s.client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, seed=seed
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, {"get_weather"})
    stream = await s.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named, stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # the call's JSON never streams as content
    [call] = [tc for d in deltas for tc in d.tool_calls or []]
    assert call.function and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments or ""), SCHEMAS["get_weather"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_required_tool_choice_calls_one_of_the_tools(
    serve: ServeFactory, parallel: bool
) -> None:
    s = await serve()
    for seed in range(3):
        answer = await s.client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", seed=seed,
            parallel_tool_calls=parallel, max_tokens=400,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        if not parallel:
            assert len(choice.message.tool_calls or []) == 1


FORCED_CALL = (  # what the ebnf makes the tiny model write: a sentence, then a Hermes call
    'root ::= "Checking." "<tool_call>" '
    '"{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Rome\\", \\"days\\": 2}}" '
    '"</tool_call>"'
)


async def test_auto_calls_are_read_by_the_parser_whole_and_streamed(serve: ServeFactory) -> None:
    s = await serve(tool_call_parser="hermes")
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    answer = await s.client.chat.completions.create(**body, extra_body={"ebnf": FORCED_CALL})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {
        "city": "Rome",
        "days": 2,
    }
    stream = await s.client.chat.completions.create(
        **body, stream=True, extra_body={"ebnf": FORCED_CALL}
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking."  # the tag never leaks into the content
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls if c.function] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = await s.client.chat.completions.create(**body, extra_body={"ebnf": 'root ::= "No."'})
    assert plain.choices[0].message.content == "No." and plain.choices[0].finish_reason == "stop"


async def test_auto_without_a_parser_and_bad_tools_are_400s(serve: ServeFactory) -> None:
    s = await serve()
    cases = [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto by default: no parser for this template
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": 3}}], "tool_choice": "required"},
            "tools[0].function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "tool_choice"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ]
    for fields, param in cases:
        status, got = await post(
            s, "/v1/chat/completions", {"model": MODEL, "messages": ASK, **fields}
        )
        assert status == 400 and got["error"]["param"] == param, (fields, got)
    none = await s.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    assert none.choices[0].message.tool_calls is None


async def test_tools_calls_and_results_reach_the_template(
    serve: ServeFactory, tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template that shows tools: the server reads auto calls in its format (hermes, named
    by its <tool_call>) without a flag; the assistant's calls and the tool's answer are
    rendered, never dropped; chat_template_kwargs reach the template."""
    monkeypatch.setattr(tiny_model.tokenizer, "chat_template", TOOL_TEMPLATE)
    s = await serve()
    admitted = Admitted(s.engine, monkeypatch)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}  # fmt: skip  # noqa: E501
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    answer = await s.client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, CLOCK], max_tokens=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    [admit] = admitted.take()
    text = s.engine.tokenizer.decode(list(admit.prompt_ids))
    assert "Tools: get_weather,get_time" in text
    assert '<tool_call>get_weather {"city": "Oslo", "days": 1}</tool_call>' in text
    assert "<|im_start|>toolSunny, 21 C<|im_end|>" in text and "NOTHINK" in text
    status, got = await post(s, "/v1/chat/completions", {"model": MODEL, "messages": [
        *ASK, {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]}]})  # fmt: skip  # noqa: E501
    assert status == 400 and got["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


THINKING = 'root ::= "<think>" "Rome is warm." "</think>" "\\n\\n" "It is sunny."'


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reasoning_parser_splits_the_think_block(serve: ServeFactory, stream: bool) -> None:
    s = await serve(reasoning_parser="qwen3")
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 200,
                            "extra_body": {"ebnf": THINKING}}  # fmt: skip
    if not stream:
        answer = await s.client.chat.completions.create(**body)
        message = answer.choices[0].message
        assert message.content == "It is sunny."
        assert getattr(message, "reasoning_content", None) == "Rome is warm."
        return
    chunks = [c async for c in await s.client.chat.completions.create(**body, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Rome is warm."
