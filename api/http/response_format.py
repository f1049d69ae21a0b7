"""OpenAI's response_format in the engine's terms: the grammar field it asks for
(SamplingParams.json_schema or structural_tag), or nothing for plain text.

    {"type": "text"}                                        nothing
    {"type": "json_object"}                                 json_schema '{"type": "object"}'
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                            json_schema: the schema as JSON
    {"type": "structural_tag", "format": {...}}             structural_tag: the whole of it
                                                            (SGLang's, xgrammar's format)

The output always matches the schema exactly (strict or not: a strict answer is a valid
non-strict one). SGLang's extra fields (json_schema, regex, ebnf, structural_tag) constrain
the output too; a body may ask for one constraint only.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.api.http.errors import bad_request

JSON_OBJECT = '{"type": "object"}'
TYPES = ("text", "json_object", "json_schema", "structural_tag")


def response_format_grammar(response_format: Any) -> tuple[str, str] | None:
    """The grammar field and source `response_format` asks the output to match (None: plain
    text). 400 naming the part that is wrong."""
    if response_format is None or response_format.type == "text":
        return None
    kind = response_format.type
    if kind not in TYPES:
        raise bad_request(
            f"response_format.type must be one of {list(TYPES)}, got {kind!r}",
            "response_format.type",
        )
    if kind == "json_object":
        return "json_schema", JSON_OBJECT
    if kind == "structural_tag":
        if not isinstance(response_format.format, dict):
            message = "response_format.format must be a structural tag's format object"
            raise bad_request(message, "response_format.format")
        return "structural_tag", json.dumps({"type": kind, "format": response_format.format})
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        where = "response_format.json_schema" + ("" if spec is None else ".schema")
        raise bad_request(f"{where} is required with type json_schema", where)
    if not isinstance(spec.schema_, dict | bool):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON object (or a boolean), got "
            f"{type(spec.schema_).__name__}",
            "response_format.json_schema.schema",
        )
    return "json_schema", json.dumps(spec.schema_)
