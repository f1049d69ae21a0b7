"""Every door takes every SamplingParams field (issue 13, item 2), generated from the struct:
the OpenAI chat and completions routes, /generate, the session websocket, the command line,
Engine.generate and Session.turn each hand the engine exactly the SamplingParams the fields
ask for, under the door's wire names (api/sampling_wire.py, WIRE_NAMES). A field added to
SamplingParams fails until tests/support/sampling_examples.py's EXAMPLES has a value for it (one for
every field, all sent at once here: EXPECTED); the doors need nothing.

Also: a field not given is its declared default at every door (but the doors' own rules:
OpenAI's and /generate's max tokens, the command line's greedy answer), and the sampling is
validated once per engine request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import pytest
from admitted import Admitted
from doors import PROMPT, ws_turn
from sampling_examples import EXAMPLES, GRAMMAR_EXAMPLES
from served import MODEL, Served, ServeFactory, post_ok

from shoal.api.cli import build_parser
from shoal.api.sampling_wire import (
    IN_SAMPLING,
    LOGPROBS,
    NATIVE_ONLY,
    ROUTED_EXPERTS,
    SAMPLING_FIELDS,
    WIRE_NAMES,
    sampling_from_args,
)
from shoal.params import SamplingParams

# The routed experts' fields ask what only a mixture-of-experts model answers (a dense one
# refuses return_routed_experts: tests/engine/test_routed_experts_answer.py); this test's
# model is dense, so every door but the command line's parser is sent their defaults.
DENSE_EXAMPLES = {field: v for field, v in EXAMPLES.items() if field not in ROUTED_EXPERTS}
EXPECTED = SamplingParams(**DENSE_EXAMPLES)


def expected_at(door: str) -> SamplingParams:
    """EXPECTED, but for the prompt logprobs' fields a door has no name for (NATIVE_ONLY: the
    OpenAI doors ask with echo and prompt_logprobs, the websocket not at all): their default."""
    names = WIRE_NAMES[door]
    untaken = [field for field in NATIVE_ONLY if names.get(field, field) is None]
    defaults = {field: getattr(SamplingParams(), field) for field in untaken}
    return msgspec.structs.replace(EXPECTED, **defaults)


def wire(door: str, fields: Iterable[str] = SAMPLING_FIELDS) -> dict[str, Any]:
    """EXAMPLES as the door's wire spells them (JSON: tuples are lists)."""
    names = WIRE_NAMES[door]
    body = {}
    for field in fields:
        name = names.get(field, field)
        if name is not None and field in DENSE_EXAMPLES:
            value = EXAMPLES[field]
            body[name] = list(value) if isinstance(value, tuple) else value
    return body


def argv() -> list[str]:
    """EXAMPLES as `generate` flags."""
    out = []
    for field, value in EXAMPLES.items():
        flag = "--" + field.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, tuple):
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, dict):
            for key, item in value.items():
                out += [flag, f"{key}={item}"]
        else:
            out += [flag, str(value)]
    return out


class Received:
    """The SamplingParams of every request the engine admits: as the scheduler receives it,
    once its prompt is measured (where a max tokens not given is sized to the room)."""

    def __init__(self, s: Served, monkeypatch: pytest.MonkeyPatch) -> None:
        self.admitted = Admitted(s.engine, monkeypatch)

    def take(self) -> SamplingParams:
        [admit] = self.admitted.take()
        return admit.sampling


def test_the_command_line_takes_every_field_and_defaults_to_the_declaration() -> None:
    parser = build_parser()
    every = SamplingParams(**EXAMPLES)
    assert sampling_from_args(parser.parse_args(["generate", "hi", *argv()])) == every
    greedy = SamplingParams(temperature=0.0)  # `generate`'s own rule: greedy unless asked
    assert sampling_from_args(parser.parse_args(["generate", "hi"])) == greedy


async def test_every_door_takes_every_field(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await serve()
    received = Received(s, monkeypatch)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    await post_ok(s, "/v1/chat/completions", {**chat, **wire("chat")})
    assert received.take() == expected_at("chat"), "chat"
    await post_ok(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **wire("completions")})
    assert received.take() == expected_at("completions"), "completions"
    native = {"input_ids": PROMPT, "sampling_params": wire("native", IN_SAMPLING)}
    await post_ok(s, "/generate", {**native, **wire("native", LOGPROBS)})
    assert received.take() == EXPECTED, "native"
    done = await ws_turn(s, **wire("websocket"))
    assert done["type"] == "done", done
    assert received.take() == expected_at("websocket"), "websocket"
    await s.engine.generate(input_ids=PROMPT, **DENSE_EXAMPLES).result()
    assert received.take() == EXPECTED, "Engine.generate"
    async with await s.engine.open_session() as session:
        await session.turn(input_ids=PROMPT, **DENSE_EXAMPLES).result()
    assert received.take() == EXPECTED, "Session.turn"


@pytest.mark.parametrize("kind", sorted(GRAMMAR_EXAMPLES))
async def test_every_door_takes_every_grammar_field(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The grammar fields exclude each other, so EXAMPLES carries one (the regex): each is
    sent alone here, through every door, and reaches the engine as given."""
    s = await serve()
    received = Received(s, monkeypatch)
    source = GRAMMAR_EXAMPLES[kind]
    fields = {kind: source, "max_new_tokens": 2}
    expected = SamplingParams(max_new_tokens=2, **{kind: source})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    await post_ok(s, "/v1/chat/completions", {**chat, "max_tokens": 2, kind: source})
    assert received.take() == expected, "chat"
    await post_ok(
        s, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, kind: source}
    )
    assert received.take() == expected, "completions"
    await post_ok(s, "/generate", {"input_ids": PROMPT, "sampling_params": fields})
    assert received.take() == expected, "native"
    done = await ws_turn(s, max_tokens=2, **{kind: source})
    assert done["type"] == "done", done
    assert received.take() == expected, "websocket"
    await s.engine.generate(input_ids=PROMPT, **fields).result()
    assert received.take() == expected, "Engine.generate"
    async with await s.engine.open_session() as session:
        await session.turn(input_ids=PROMPT, **fields).result()
    assert received.take() == expected, "Session.turn"


async def test_a_field_not_given_is_its_declared_default_at_every_door(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await serve(context_length=256)
    received = Received(s, monkeypatch)
    declared = SamplingParams()
    room = 256 - len(PROMPT)  # OpenAI: max_tokens not given is the room the prompt leaves
    await post_ok(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT})
    assert received.take() == SamplingParams(max_new_tokens=room)
    await post_ok(s, "/generate", {"input_ids": PROMPT})
    assert received.take() == declared  # the declared 128, capped at the room (not reached)
    await post_ok(s, "/generate", {"input_ids": [5] * 200})
    assert received.take() == SamplingParams(max_new_tokens=56)
    await ws_turn(s)
    assert received.take() == declared
    async with s.http.post(s.url + "/open_session", json={}) as resp:
        session_id = (await resp.json())["session_id"]
    turn = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    await post_ok(s, "/v1/chat/completions", {**turn, "session_params": {"id": session_id}})
    assert received.take() == declared  # a chat turn: the declared default
    async with s.http.post(s.url + "/close_session", json={"session_id": session_id}) as resp:
        assert resp.status == 200
    await s.engine.generate(input_ids=PROMPT).result()
    assert received.take() == declared


async def test_sampling_is_validated_once_per_engine_request(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await serve(max_n=4)
    calls = []
    validate = SamplingParams.validate

    def counted(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        validate(self, *args, **kwargs)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    await post_ok(s, "/v1/chat/completions", chat)
    assert len(calls) == 1
    await post_ok(s, "/v1/chat/completions", {**chat, "n": 3})
    assert len(calls) == 4  # one per choice: each is an engine request
    await post_ok(s, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert len(calls) == 5
    await ws_turn(s, max_tokens=2)
    assert len(calls) == 6
    async with s.http.post(s.url + "/v1/chat/completions", json={**chat, "top_k": 0}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "top_k"
    assert len(calls) == 7
