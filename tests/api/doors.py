"""What the door tests send: one prompt, and a websocket session's single turn.

done = await ws_turn(s, max_tokens=2)     # the turn's fields as the websocket spells them
"""

from __future__ import annotations

from typing import Any

from served import Served

PROMPT = [5, 6, 7]


async def ws_turn(s: Served, **fields: Any) -> dict[str, Any]:
    """Open a session on a websocket, run one turn to its done, close; the done."""
    async with s.http.ws_connect(s.url + "/v1/sessions/ws") as ws:
        await ws.send_json({"type": "open"})
        assert (await ws.receive_json(timeout=60))["type"] == "opened"
        await ws.send_json({"type": "turn", "input_ids": PROMPT, **fields})
        while True:
            done: dict[str, Any] = await ws.receive_json(timeout=60)
            if done["type"] != "delta":
                break
        await ws.send_json({"type": "close"})
        assert (await ws.receive_json(timeout=60))["type"] == "closed"
    return done
