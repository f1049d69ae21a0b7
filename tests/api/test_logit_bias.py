"""OpenAI's logit_bias, end to end through the per-request seam (issue 30, item 7): every door
hands it to the engine (tests/api/test_sampling_doors.py checks the SamplingParams each door
builds), the executor makes it a row constraint (kernels/constraints.py) and sampling adds it
to the row's logits. Checked against transformers' sequence_bias (the same addition) and at
every door by the tokens it forces; its refusals name the field at every door."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from doors import PROMPT, ws_turn
from engines import EngineFactory
from reference import Reference
from served import MODEL, Served, ServeFactory, post_ok

from shoal.kernels.logit_bias import LogitBias
from shoal.kernels.sampling import SamplingRow, sample
from shoal.params import SamplingParams
from shoal.results import RequestError

FORCED = 77  # +100 on one token: every greedy step takes it
FORCE = {FORCED: 100.0}
N = 4


def wire(bias: dict[int, float]) -> dict[str, float]:
    """As JSON spells it: token ids as the object's keys."""
    return {str(token): value for token, value in bias.items()}


def prompts_and_biases() -> list[tuple[list[int], dict[int, float]]]:
    """Seeded cases: a ban of the unbiased greedy path's tokens, small pushes, mixed signs."""
    rng = random.Random(30)
    cases = []
    for i in range(6):
        prompt = [rng.randrange(3, 500) for _ in range(3 + 4 * i)]
        bias = {rng.randrange(3, 500): rng.choice([-100.0, -3.5, 2.0, 6.0]) for _ in range(5)}
        cases.append((prompt, bias))
    return cases


def biased_row(bias: dict[int, float], seed: int = 0, **params: Any) -> SamplingRow:
    sampling = SamplingParams(logit_bias=bias, **params)
    constraints = (LogitBias(bias, torch.device("cpu")),) if bias else ()
    return SamplingRow(sampling, seed, (), (), 0, constraints)


def test_sampling_adds_the_bias_to_its_row_only() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    low = int(logits[1].argmin())
    rows = [biased_row({}), biased_row({low: 100.0}, temperature=0.0), biased_row({}, seed=5)]
    alone = sample(logits[2:], [rows[2]])
    tokens = sample(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are never written to
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[1]) == low
    assert int(tokens[2]) == int(alone[0])  # a neighbour's bias never moves a row


def test_a_ban_is_never_drawn() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 3] = 20.0  # all but certain without the ban
    for seed in range(50):
        assert int(sample(logits, [biased_row({3: -100.0}, seed=seed)])[0]) != 3


async def test_the_engine_adds_the_bias_as_transformers_does(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """Greedy answers with a bias equal transformers' sequence_bias answers, several requests
    batched together beside unbiased ones (whose answers the neighbours' biases never touch)."""
    engine = await make_engine(page_size=4, chunk_size=16)
    cases = prompts_and_biases()
    # Bans of the unbiased answer's own tokens: the bias must move the answer.
    plain = tiny_reference.greedy(cases[0][0], 6, True)
    cases.append((cases[0][0], dict.fromkeys(plain[:3], -100.0)))
    streams = []
    for prompt, bias in cases:
        for logit_bias in (bias, {}):
            stream = engine.generate(
                input_ids=prompt,
                max_new_tokens=6,
                temperature=0.0,
                ignore_eos=True,
                logit_bias=logit_bias,
            )
            streams.append((prompt, logit_bias, stream))
    for prompt, logit_bias, stream in streams:
        done = await stream.result()
        expected = tiny_reference.greedy(prompt, 6, True, logit_bias)
        assert list(done.token_ids) == expected, (prompt, logit_bias)
    last_prompt, last_bias, _ = streams[-2]
    assert tiny_reference.greedy(last_prompt, 6, True, last_bias) != plain


async def test_a_ban_holds_when_sampling(make_engine: EngineFactory) -> None:
    """-100 bans a token under temperature sampling too: the most likely tokens, banned, never
    come, whatever the seed."""
    engine = await make_engine()
    free = await engine.generate(input_ids=PROMPT, max_new_tokens=24, seed=1).result()
    banned = dict.fromkeys(set(free.token_ids), -100.0)
    for seed in range(4):
        done = await engine.generate(
            input_ids=PROMPT, max_new_tokens=24, seed=seed, logit_bias=banned, ignore_eos=True
        ).result()
        assert not set(done.token_ids) & set(banned), seed


async def test_every_door_honours_it(serve: ServeFactory) -> None:
    """+100 on one token forces it at every step through the OpenAI routes, /generate, the
    session websocket, Engine.generate and Session.turn."""
    s = await serve()
    text = s.engine.tokenizer.decode([FORCED] * N)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": N}
    got = await post_ok(s, "/v1/chat/completions", {**chat, "logit_bias": wire(FORCE)})
    assert got["choices"][0]["message"]["content"] == text
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "logit_bias": wire(FORCE)}
    got = await post_ok(s, "/v1/completions", body)
    assert got["choices"][0]["text"] == text
    sampling = {"max_new_tokens": N, "logit_bias": wire(FORCE)}
    got = await post_ok(s, "/generate", {"input_ids": PROMPT, "sampling_params": sampling})
    assert got["output_ids"] == [FORCED] * N
    done = await ws_turn(s, max_tokens=N, logit_bias=wire(FORCE), ignore_eos=True)
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == N, done
    await ws_forced(s)
    result = await s.engine.generate(input_ids=PROMPT, max_new_tokens=N, logit_bias=FORCE).result()
    assert list(result.token_ids) == [FORCED] * N
    async with await s.engine.open_session() as session:
        turn = await session.turn(input_ids=PROMPT, max_new_tokens=N, logit_bias=FORCE).result()
    assert list(turn.token_ids) == [FORCED] * N


async def ws_forced(s: Served) -> None:
    """The websocket's deltas carry the forced token, turn after turn (each its own bias)."""
    async with s.http.ws_connect(s.url + "/v1/sessions/ws") as ws:
        await ws.send_json({"type": "open"})
        assert (await ws.receive_json(timeout=60))["type"] == "opened"
        for bias in (FORCE, {FORCED + 1: 100.0}):
            turn = {"type": "turn", "input_ids": PROMPT, "max_tokens": N}
            await ws.send_json({**turn, "logit_bias": wire(bias), "ignore_eos": True})
            tokens: list[int] = []
            while (reply := await ws.receive_json(timeout=60))["type"] == "delta":
                tokens += reply["token_ids"]
            assert reply["type"] == "done", reply
            assert tokens == [*bias] * N
        await ws.send_json({"type": "close"})
        assert (await ws.receive_json(timeout=60))["type"] == "closed"


BAD: list[tuple[str, Any, str]] = [
    ("out of the vocabulary", {"512": 1.0}, "keys must be valid token ids"),
    ("negative id", {"-1": 1.0}, "keys must be valid token ids"),
    ("over 100", {"5": 100.5}, "values must be in [-100, 100]"),
    ("under -100", {"5": -101}, "values must be in [-100, 100]"),
]


@pytest.mark.parametrize(("case", "bias", "says"), BAD, ids=[b[0] for b in BAD])
async def test_a_bad_bias_is_refused_at_every_door_naming_it(
    serve: ServeFactory, case: str, bias: Any, says: str
) -> None:
    s = await serve()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for path, body, param in (
        ("/v1/chat/completions", {**chat, "logit_bias": bias}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "logit_bias": bias}, "logit_bias"),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"logit_bias": bias}},
            "sampling_params.logit_bias",
        ),
    ):
        async with s.http.post(s.url + path, json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400, (path, error)
        assert error["param"] == param and says in error["message"], (path, error)
    done = await ws_turn(s, max_tokens=1, logit_bias=bias)
    assert done["type"] == "error" and done["param"] == "logit_bias", done
    assert says in done["message"], done
    python_bias = {int(token): value for token, value in bias.items()}
    with pytest.raises(RequestError, match="logit_bias") as refused:
        s.engine.generate(input_ids=PROMPT, logit_bias=python_bias)
    assert refused.value.field == "logit_bias"


async def test_a_key_that_is_no_token_id_is_a_400(serve: ServeFactory) -> None:
    s = await serve()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "logit_bias": {"five": 1.0}}
    async with s.http.post(s.url + "/v1/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "logit_bias", error
