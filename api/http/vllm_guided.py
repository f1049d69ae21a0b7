"""vLLM's names for a constraint at the OpenAI doors, in the engine's terms (its grammar fields,
params.GRAMMAR_KINDS), beside OpenAI's response_format (response_format.py) and SGLang's own
fields:

    guided_json, structured_outputs.json        json_schema (a schema object, or its JSON text)
    guided_regex, structured_outputs.regex      regex
    guided_grammar, structured_outputs.grammar  ebnf (xgrammar's EBNF, as vLLM's xgrammar
                                                backend reads it)
    guided_choice, structured_outputs.choice    ebnf: exactly one of the strings
    structured_outputs.json_object              json_schema {"type": "object"}
    structured_outputs.structural_tag           structural_tag

    asked = vllm_constraints(body)      # [(the field as sent, kind, source)], 400 if malformed
"""

from __future__ import annotations

import json
from typing import Any

from shoal.api.http.errors import bad_request
from shoal.api.http.response_format import JSON_OBJECT


def _schema(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | bool):
        return json.dumps(value)
    raise bad_request(f"{where} must be a JSON schema (an object, or its JSON text)", where)


def choice_grammar(choices: Any, where: str) -> str:
    """An EBNF grammar whose one sentence is any of `choices` (each a JSON-escaped literal:
    xgrammar's EBNF reads its escapes; non-ASCII stays as written)."""
    if not isinstance(choices, list) or not choices:
        raise bad_request(f"{where} must be a non-empty list of strings", where)
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise bad_request(f"{where}[{i}] must be a non-empty string", f"{where}[{i}]")
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {literals}"


def vllm_constraints(body: Any) -> list[tuple[str, str, str]]:
    asked: list[tuple[str, str, str]] = []
    if body.guided_json is not None:
        asked.append(("guided_json", "json_schema", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        asked.append(("guided_regex", "regex", body.guided_regex))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", "ebnf", body.guided_grammar))
    if body.guided_choice is not None:
        asked.append(("guided_choice", "ebnf", choice_grammar(body.guided_choice, "guided_choice")))
    outputs = body.structured_outputs
    if outputs is None:
        return asked
    name = "structured_outputs."
    if outputs.json is not None:
        asked.append((name + "json", "json_schema", _schema(outputs.json, name + "json")))
    if outputs.regex is not None:
        asked.append((name + "regex", "regex", outputs.regex))
    if outputs.grammar is not None:
        asked.append((name + "grammar", "ebnf", outputs.grammar))
    if outputs.choice is not None:
        asked.append((name + "choice", "ebnf", choice_grammar(outputs.choice, name + "choice")))
    if outputs.json_object:
        asked.append((name + "json_object", "json_schema", JSON_OBJECT))
    if outputs.structural_tag is not None:
        asked.append((name + "structural_tag", "structural_tag", outputs.structural_tag))
    return asked
