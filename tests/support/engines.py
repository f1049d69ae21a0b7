"""Helpers for the tests that start engines (conftest.py's `make_engine`).

    async def test_x(make_engine: EngineFactory) -> None:
        engine = await make_engine(page_size=4)    # Engine options; seed 0, strict integrity

`message_kinds` names the kinds of a mailbox's message union that a fault can be armed on.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from shoal.actors.messages import Shutdown

EngineFactory = Callable[..., Any]


def message_kinds(union: Any) -> list[str]:
    """The names of the union's message kinds, but Shutdown (which ends the actor)."""
    return [t.__name__ for t in typing.get_args(union) if t is not Shutdown]
