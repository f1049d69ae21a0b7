"""What the grammar tests share: a schema heavy enough to take a while to compile (xgrammar's
time grows with its fields and their patterns), and the compiler of the tiny model's
vocabulary (kernels/grammars.py)."""

from __future__ import annotations

import json
from typing import Any

from tiny_model import EOS_ID

from shoal.kernels.grammars import Grammars


def heavy_schema(fields: int) -> str:
    """An object of `fields` arrays of objects, each with its own string pattern."""
    properties = {
        f"f{i}": {"type": "array", "items": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": f"[a-z]{{1,{i + 5}}}"}, "b": {"type": "number"},
        }}}
        for i in range(fields)
    }  # fmt: skip
    return json.dumps({"type": "object", "properties": properties})


def tiny_grammars(tokenizer: Any) -> Grammars:
    """The tiny model's compiler: its 512 ids, ending on its EOS."""
    return Grammars(tokenizer, 512, (EOS_ID,), 64 << 20)
