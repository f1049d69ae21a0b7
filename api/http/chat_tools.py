"""OpenAI's tools at the chat door: the functions a request offers (to the chat template),
how the model must use them (`tool_choice`), and its answer's text as `tool_calls`.

    plan = tool_plan(tools, tool_choice, parallel_tool_calls, parser_name)   # 400 if bad
    plan.schema                              # the grammar "required" and a named choice add
    calls = plan.calls_of(text)              # the answer's calls (after its finish)

- "none" (the default without tools): the template sees the tools, the answer is text.
- "auto" (the default with tools): the answer is free; calls in it are read with the tool-call
  parser (api/http/tool_parsers.py: `--tool-call-parser`, else the one the template shows);
  without one "auto" is a 400 that says which to start with.
- "required" and a named function ({"type": "function", "function": {"name": ...}}): a JSON
  schema constrains the answer, as vLLM does it, so any model calls correctly: a named call's
  answer is its arguments' object; "required"'s a list of {"name", "parameters"} (one item
  unless parallel_tool_calls), each name one of the tools with its own parameters.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from shoal.api.http.errors import bad_request
from shoal.api.http.tool_parsers import PARSERS, Call, ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # as the chat template takes them (OpenAI's shape)
    mode: str  # none | auto | required | named
    named: str | None = None
    schema: str | None = None  # the json_schema constraint of required and named
    parser: ToolParser | None = None  # auto's

    @property
    def calls_expected(self) -> bool:
        return self.mode in ("required", "named") or self.parser is not None

    def calls_of(self, text: str) -> tuple[str | None, list[Call]]:
        """The answer's (content, calls): required's and named's from their JSON (a text
        that is not whole, cut by max_tokens, stays content); auto's by its parser."""
        if self.mode == "named":
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []
            assert self.named is not None
            return None, [(self.named, json.dumps(arguments, ensure_ascii=False))]
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [
                    (str(item["name"]), json.dumps(item["parameters"], ensure_ascii=False))
                    for item in items
                ]
            except (ValueError, TypeError, KeyError):  # not what the schema makes: text
                return text, []
            return None, calls
        if self.parser is not None:
            content, calls = self.parser.parse(text)
            return (content or None) if calls else content, calls
        return text, []


def tool_plan(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser_name: str | None
) -> ToolPlan | None:
    """The request's plan (None: no tools and no choice that asks for one)."""
    functions = _functions(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    offered = tuple({"type": "function", "function": f} for f in functions)
    if choice == "none" or (choice == "auto" and not functions):  # nothing to call
        return ToolPlan(offered, "none") if functions else None
    if not functions:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    parallel = True if parallel is None else bool(parallel)
    if choice == "auto":
        if parser_name is None:
            raise bad_request(
                "tool_choice auto needs a tool-call parser, and this model's chat template "
                "shows no tool-call format: start the server with --tool-call-parser "
                f"({', '.join(PARSERS)}), or send tool_choice required or a named function",
                "tool_choice",
            )
        return ToolPlan(offered, "auto", parser=PARSERS[parser_name])
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "parameters": f.get("parameters") or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
            }
            for f in functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(offered, "required", schema=json.dumps(schema))
    name = _named(choice)
    by_name = {f["name"]: f for f in functions}
    if name not in by_name:
        raise bad_request(
            f"tool_choice names {name!r}, which is not one of the tools {sorted(by_name)}",
            "tool_choice",
        )
    parameters = by_name[name].get("parameters") or ANY_OBJECT
    return ToolPlan(offered, "named", name, json.dumps(parameters))


def _functions(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.function.name must be a string", f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            where = f"{where}.function.parameters"
            raise bad_request(f"{where} must be a JSON schema object", where)
        out.append(function)
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    return out


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return str(function["name"])


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
