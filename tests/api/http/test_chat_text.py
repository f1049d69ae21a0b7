# ruff: noqa: E501  (the parser cases read best one to a line)
"""The chat answer's parts without a server: tool-call parsers (api/http/tool_parsers.py),
the reasoning split (api/http/reasoning.py) and one choice's text (api/http/chat_text.py).
A stream cut at every character gives the whole answer's parts."""

from __future__ import annotations

import json

import pytest

from shoal.api.http.chat_text import ChoiceText, whole_message
from shoal.api.http.chat_tools import tool_plan
from shoal.api.http.errors import ApiError
from shoal.api.http.reasoning import PARSERS as REASONING
from shoal.api.http.reasoning import split_whole
from shoal.api.http.tool_parsers import PARSERS, parser_for_template

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "time"}}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Sure.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
         "Sure.", [("weather", '{"city": "Oslo"}')]),
        ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
         "", [("a", "{}"), ("b", '{"x": 1}')]),
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("hermes", "no call here", "no call here", []),
        ("llama3_json", '{"name": "weather", "parameters": {"city": "Rome"}}', "", [("weather", '{"city": "Rome"}')]),
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', "", [("a", "{}"), ("b", "{}")]),
        ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
        ("mistral", 'ok [TOOL_CALLS] [{"name": "time", "arguments": {}}]', "ok", [("time", "{}")]),
        ("mistral", "[TOOL_CALLS] [broken", "[TOOL_CALLS] [broken", []),
    ],
)  # fmt: skip
def test_parsers_read_calls_and_keep_the_rest(
    parser: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert PARSERS[parser].parse(text) == (content, calls)


def test_the_template_names_its_format() -> None:
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template("{{ message['content'] }}") is None


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
        ("qwen3", "The answer, no thinking.", None, "The answer, no thinking."),
        ("qwen3", "<think>cut short", "cut short", ""),
        ("deepseek_r1", "plan it</think>answer", "plan it", "answer"),
        ("deepseek_r1", "<think>plan</think> answer", "plan", "answer"),
    ],
)
def test_reasoning_splits_whole_and_streamed_alike(
    parser: str, text: str, reasoning: str | None, content: str
) -> None:
    assert split_whole(REASONING[parser], text) == (reasoning, content)
    for cut in range(1, len(text)):  # every two-delta stream
        choice = ChoiceText(None, REASONING[parser])
        parts = [choice.feed(text[:cut]), choice.feed(text[cut:])]
        end, finish = choice.end("stop")
        thought = "".join((p.reasoning_content or "") for p in [*parts, end] if p is not None)
        said = "".join((p.content or "") for p in [*parts, end] if p is not None)
        assert (thought, said) == (reasoning or "", content), cut
        assert finish == "stop"


def streamed(choice: ChoiceText, text: str, step: int) -> tuple[str, list[tuple[str, str]], str]:
    """(content, calls, finish) of `text` streamed `step` characters a delta."""
    deltas = [choice.feed(text[i : i + step]) for i in range(0, len(text), step)]
    end, finish = choice.end("stop")
    content = "".join(d.content or "" for d in [*deltas, end] if d is not None)
    calls = [(c.function.name, c.function.arguments) for c in end.tool_calls or [] if c.function]
    return content, calls, finish


def test_auto_streams_content_and_holds_back_a_call() -> None:
    plan = tool_plan([WEATHER, TIME], None, None, "hermes")
    assert plan is not None and plan.mode == "auto" and plan.schema is None
    text = 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    for step in (1, 3, 7, len(text)):
        choice = ChoiceText(plan, None)
        content, calls, finish = streamed(choice, text, step)
        assert (content, calls, finish) == (
            "Let me look.",
            [("weather", '{"city": "Oslo"}')],
            "tool_calls",
        )
    message, finish = whole_message(text, "stop", plan, None)
    assert message.content == "Let me look." and finish == "tool_calls"
    assert message.tool_calls and message.tool_calls[0].function.name == "weather"
    plain, finish = whole_message("Just text <tool", "stop", plan, None)
    assert (plain.content, plain.tool_calls, finish) == ("Just text <tool", None, "stop")


def test_required_and_named_choices_become_schemas_and_calls() -> None:
    required = tool_plan([WEATHER, TIME], "required", False, None)
    assert required is not None and required.schema is not None
    schema = json.loads(required.schema)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "weather", "parameters": {"city": "Rome"}}]'
    content, calls, finish = streamed(ChoiceText(required, None), text, 5)
    assert (content, calls, finish) == ("", [("weather", '{"city": "Rome"}')], "tool_calls")
    named = tool_plan(
        [WEATHER, TIME], {"type": "function", "function": {"name": "weather"}}, None, None
    )
    assert named is not None and json.loads(named.schema or "") == WEATHER["function"]["parameters"]
    message, finish = whole_message('{"city": "Rome"}', "stop", named, None)
    assert message.content is None and finish == "tool_calls"
    cut, finish = whole_message('{"city": "Ro', "length", named, None)  # max_tokens cut it
    assert (cut.content, cut.tool_calls, finish) == ('{"city": "Ro', None, "length")


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "says"),
    [
        ([WEATHER], "auto", None, "needs a tool-call parser"),
        (None, "required", None, "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "not one of the tools"),
        ([WEATHER], "sometimes", None, "tool_choice must be"),
        ([{"type": "function"}], "required", None, "function.name"),
        ([WEATHER, WEATHER], "required", None, "distinct"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(
    tools: list[object] | None, choice: object, parser: str | None, says: str
) -> None:
    with pytest.raises(ApiError) as raised:
        tool_plan(tools, choice, None, parser)
    assert says in str(raised.value), raised.value
