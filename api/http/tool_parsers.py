"""Tool calls in a model's text, in the formats model families are trained on
(`--tool-call-parser`), for `tool_choice` "auto": the text becomes content and calls.

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block a call
                  (Hermes, Qwen 2.5 and 3)
    llama3_json   {"name": ..., "parameters": {...}} as the whole answer, or several joined
                  by ";" (Llama 3.1, 3.2), after an optional <|python_tag|>
    mistral       [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

    parser = PARSERS["hermes"]
    content, calls = parser.parse(text)       # calls: [(name, arguments as JSON text)]
    parser.start                              # where calls begin (streaming holds from there)

A block that does not parse as a call stays in the content, as written: nothing the model
said is lost. `parser_for_template` names the format a chat template shows, if any.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

Call = tuple[str, str]  # (name, arguments as JSON text)


def _call_of(value: Any, arguments_key: str) -> Call | None:
    """(name, arguments) of one decoded call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolParser:
    name: str
    start: str  # the text where calls begin ("" for llama3_json: an answer that opens with "{")

    def parse(self, text: str) -> tuple[str, list[Call]]:
        if self.name == "hermes":
            return _hermes(text)
        if self.name == "mistral":
            return _mistral(text)
        return _llama3(text)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[Call]]:
    calls: list[Call] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            call = _call_of(json.loads(match[1]), "arguments")
        except ValueError:
            call = None
        if call is None:
            continue  # stays in the content as written
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _mistral(text: str) -> tuple[str, list[Call]]:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    body = text[at + len("[TOOL_CALLS]") :].strip()
    try:
        decoded, _ = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return text, []
    items = decoded if isinstance(decoded, list) else [decoded]
    calls = [c for c in (_call_of(item, "arguments") for item in items) if c is not None]
    if len(calls) != len(items):
        return text, []
    return text[:at].strip(), calls


def _llama3(text: str) -> tuple[str, list[Call]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls: list[Call] = []
    decoder = json.JSONDecoder()
    rest = body
    while rest:
        try:
            decoded, end = decoder.raw_decode(rest)
        except ValueError:
            return text, []
        call = _call_of(decoded, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end:].strip().removeprefix(";").strip()
    return "", calls


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", "<tool_call>"),
    "llama3_json": ToolParser("llama3_json", ""),
    "mistral": ToolParser("mistral", "[TOOL_CALLS]"),
}


def parser_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template writes calls in, or None where it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    return None
