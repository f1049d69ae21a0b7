"""Structured output (issue 34): a request's json_schema, regex, ebnf or structural_tag is a
row constraint (kernels/grammar_row.py) compiled by xgrammar (kernels/grammars.py).

Greedy rows with a grammar give exactly transformers' greedy tokens under the same mask
(support/reference.py, GrammarMask), with page sizes 1 and 16, chunked prefill, prefix hits,
pipeline stages, a retraction and a session turn; the plain rows beside them keep their own
greedy tokens bit for bit. Every sampled output matches its grammar, at every temperature, over
generated schemas, regular expressions and EBNF grammars. Abort, stop strings, logprobs and
ignore_eos behave as without a grammar, and a grammar that does not compile is refused,
naming its field, before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any

import jsonschema
import pytest
import regex
from engines import EngineFactory
from grammar_cases import heavy_schema, tiny_grammars
from parity import mixed_prompts
from reference import Reference

from shoal import Engine
from shoal.kernels.grammars import Grammars
from shoal.models.load import LoadedModel
from shoal.params import GrammarSpec
from shoal.results import RequestError

NEW_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
KINDS: list[GrammarSpec] = [
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("regex", "[a-z]{2,6}-[0-9]{1,3}"),
    GrammarSpec("ebnf", 'root ::= ("yes" | "no") " " [a-c]+ "."'),
    GrammarSpec(
        "structural_tag",
        '{"type": "structural_tag", "format": {"type": "const_string", "value": "done"}}',
    ),
]


def grammars_of(model: LoadedModel) -> Grammars:
    return tiny_grammars(model.tokenizer)


def masked_reference(
    reference: Reference, grammars: Grammars, prompt: list[int], spec: GrammarSpec
) -> list[int]:
    return reference.greedy(prompt, NEW_TOKENS, grammar=grammars.matcher(spec))


def matches(grammars: Grammars, spec: GrammarSpec, token_ids: tuple[int, ...], ended: bool) -> bool:
    """Whether a fresh matcher takes every token; `ended`: and the last was its end (EOS)."""
    matcher = grammars.matcher(spec)
    if not all(matcher.accept_token(t) for t in token_ids):
        return False
    return matcher.is_terminated() if ended else True


async def greedy_mix(engine: Engine, prompts: list[list[int]]) -> list[Any]:
    """Each prompt twice at once: plain, and with a grammar (KINDS in turn), greedy."""
    streams = []
    for i, prompt in enumerate(prompts):
        plain = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        spec = KINDS[i % len(KINDS)]
        streams.append(engine.generate(input_ids=prompt, **plain))
        streams.append(
            engine.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, temperature=0.0,
                            **{spec.kind: spec.source})
        )  # fmt: skip
    return list(await asyncio.gather(*(s.result() for s in streams)))


@pytest.mark.parametrize(
    "options",
    [{"page_size": 16}, {"page_size": 1, "chunk_size": 8}, {"pipeline_stages": 2}],
    ids=["page16", "page1-chunked", "two-stages"],
)
async def test_greedy_rows_with_grammars_equal_the_masked_reference_beside_plain_rows(
    make_engine: EngineFactory,
    tiny_model: LoadedModel,
    tiny_reference: Reference,
    options: dict[str, Any],
) -> None:
    engine = await make_engine(**options)
    grammars = grammars_of(tiny_model)
    prompts = mixed_prompts(tiny_model.config.vocab_size)  # prefix hits among them
    for _ in range(2):  # the second round hits the prefix cache
        done = await greedy_mix(engine, prompts)
        for i, prompt in enumerate(prompts):
            plain, constrained = done[2 * i], done[2 * i + 1]
            assert list(plain.token_ids) == tiny_reference.greedy(prompt, NEW_TOKENS, True)
            spec = KINDS[i % len(KINDS)]
            want = masked_reference(tiny_reference, grammars, prompt, spec)
            assert list(constrained.token_ids) == want, (spec.kind, i)
            ended = constrained.finish_reason == "stop"
            assert matches(grammars, spec, constrained.token_ids, ended), spec.kind


SCHEMA_TYPES = ("string", "integer", "boolean", "enum", "array", "number")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small JSON schema: an object of 1-3 properties, some nested, all required."""
    props: dict[str, Any] = {}
    for k in range(rng.randint(1, 3)):
        kind = rng.choice(SCHEMA_TYPES if depth < 1 else SCHEMA_TYPES[:4])
        name = f"{rng.choice('abcxyz')}{k}"
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rng.randint(1, 5)}
        elif kind == "integer":
            props[name] = {"type": "integer", "minimum": -50, "maximum": 50}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(["red", "green", "blue", 1, None], 2)}
        elif kind == "array":
            props[name] = {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": 2}
        elif kind == "number":
            props[name] = {"type": "number", "minimum": 0, "maximum": 10}
        else:
            props[name] = {"type": kind}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


def random_regex(rng: random.Random) -> str:
    pieces = ["[a-z]{1,4}", "[0-9]{2}", "(cat|dog|fish)", "-", "[A-F]+", "x?y", r"\.", " "]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(2, 5)))


def random_ebnf(rng: random.Random) -> str:
    words = rng.sample(["alpha", "beta", "gamma", "delta", "pi"], 3)
    alternatives = " | ".join(f'"{w}"' for w in words)
    return f'root ::= item ("," item){{0,{rng.randint(1, 3)}}}\nitem ::= {alternatives} | [0-9]+'


def generated_cases(seed: int, count: int) -> list[GrammarSpec]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        match i % 3:
            case 0:
                cases.append(GrammarSpec("json_schema", json.dumps(random_schema(rng))))
            case 1:
                cases.append(GrammarSpec("regex", random_regex(rng)))
            case _:
                cases.append(GrammarSpec("ebnf", random_ebnf(rng)))
    return cases


def check_text(spec: GrammarSpec, text: str) -> None:
    """A finished output's text is what its grammar describes (independently of xgrammar for
    schemas and regular expressions)."""
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.source))
    elif spec.kind == "regex":
        assert regex.fullmatch(spec.source, text), (spec.source, text)


async def test_every_sampled_output_matches_its_grammar(
    make_engine: EngineFactory, tiny_model: LoadedModel
) -> None:
    """At temperatures up to 2, 24 generated grammars at once: an output that ended with
    "stop" is whole (parses, validates, matches); one that ran out of tokens is a prefix its
    grammar allows."""
    engine = await make_engine()
    grammars = grammars_of(tiny_model)
    cases = generated_cases(34, 24)
    prompts = mixed_prompts(tiny_model.config.vocab_size)
    streams = [
        engine.generate(
            input_ids=prompts[i % len(prompts)],
            max_new_tokens=80,
            temperature=(0.7, 1.0, 1.5, 2.0)[i % 4],
            seed=i,
            **{spec.kind: spec.source},
        )
        for i, spec in enumerate(cases)
    ]
    done = await asyncio.gather(*(s.result() for s in streams))
    stopped = 0
    for spec, completion in zip(cases, done, strict=True):
        ended = completion.finish_reason == "stop"
        assert completion.finish_reason in ("stop", "length"), completion
        assert matches(grammars, spec, completion.token_ids, ended), (spec, completion.text)
        if ended:
            stopped += 1
            check_text(spec, completion.text)
    assert stopped >= len(cases) // 2, stopped  # most end inside 80 tokens


async def test_a_grammar_ends_its_request_with_stop_even_with_ignore_eos(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine()
    done = await engine.generate(
        input_ids=[5, 6, 7], ebnf='root ::= "ab" [0-9]', ignore_eos=True, max_new_tokens=50
    ).result()
    assert done.finish_reason == "stop" and regex.fullmatch("ab[0-9]", done.text), done


async def test_abort_stop_strings_and_logprobs_with_a_grammar(
    make_engine: EngineFactory, tiny_model: LoadedModel
) -> None:
    engine = await make_engine()
    grammars = grammars_of(tiny_model)
    prompt = mixed_prompts(tiny_model.config.vocab_size)[2]
    # abort mid-stream: the row goes, its matcher with it, and the engine serves on
    endless = GrammarSpec("regex", "[a-z]+")
    stream = engine.generate(input_ids=prompt, regex=endless.source, max_new_tokens=400)
    async for _ in stream:
        break
    stream.abort()
    aborted = await stream.result()
    assert aborted.finish_reason == "abort"
    assert matches(grammars, endless, aborted.token_ids, False)
    # a stop string inside what the grammar allows ends the request there
    spec = GrammarSpec("regex", "abc-[0-9]{3}-xyz")
    done = await engine.generate(input_ids=prompt, regex=spec.source, stop=["-"]).result()
    assert (done.finish_reason, done.text) == ("stop", "abc")
    # logprobs are the model's own (before the mask): the first position's equal a plain
    # request's, and every token reported is the one sampled
    plain = await engine.generate(
        input_ids=prompt, max_new_tokens=1, temperature=0.0, logprobs=True, top_logprobs=3
    ).result()
    constrained = await engine.generate(
        input_ids=prompt, regex="[0-9]{4}", temperature=0.0, logprobs=True, top_logprobs=3
    ).result()
    assert constrained.finish_reason == "stop" and regex.fullmatch("[0-9]{4}", constrained.text)
    assert constrained.logprobs is not None and plain.logprobs is not None
    assert constrained.logprobs[0].top == plain.logprobs[0].top
    for token, logprob in zip(constrained.token_ids, constrained.logprobs, strict=True):
        assert logprob.token_id == token


async def test_a_retracted_row_replays_its_grammar(
    make_engine: EngineFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """Pause in retract mode mid-generation: each row is rebuilt with its tokens so far, its
    matcher told them again (advance_all); the greedy tokens are the masked reference's."""
    engine = await make_engine(page_size=4)
    grammars = grammars_of(tiny_model)
    prompts = mixed_prompts(tiny_model.config.vocab_size)[:4]
    spec = KINDS[0]
    streams = [
        engine.generate(input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0.0,
                        json_schema=spec.source)
        for p in prompts
    ]  # fmt: skip
    for stream in streams:
        async for _ in stream:
            break
    engine.pause_generation("retract")
    await asyncio.sleep(0.05)
    engine.continue_generation()
    for prompt, stream in zip(prompts, streams, strict=True):
        done = await stream.result()
        assert list(done.token_ids) == masked_reference(tiny_reference, grammars, prompt, spec)


async def test_a_session_turn_with_a_grammar_equals_the_stateless_request(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine()
    spec = KINDS[2]
    first, second = [5, 6, 7, 8], [9, 10]
    async with await engine.open_session() as session:
        turn1 = await session.turn(input_ids=first, max_new_tokens=4, temperature=0.0).result()
        turn2 = await session.turn(
            input_ids=second, temperature=0.0, max_new_tokens=NEW_TOKENS, ebnf=spec.source
        ).result()
    whole = [*first, *turn1.token_ids, *second]
    alone = await engine.generate(
        input_ids=whole, temperature=0.0, max_new_tokens=NEW_TOKENS, ebnf=spec.source
    ).result()
    assert turn2.token_ids == alone.token_ids and turn2.finish_reason == "stop"


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"regex": "(("}, "regex", "not closed"),
        ({"json_schema": '{"type": "objec"}'}, "json_schema", "could not be compiled"),
        ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
        ({"ebnf": "root ::= foo"}, "ebnf", "could not be compiled"),
        ({"structural_tag": '{"a": 1}'}, "structural_tag", "could not be compiled"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
        ({"regex": ""}, "regex", "non-empty"),
    ],
)
async def test_a_bad_grammar_is_refused_naming_its_field(
    make_engine: EngineFactory, fields: dict[str, str], field: str, says: str
) -> None:
    engine = await make_engine()
    with pytest.raises(RequestError) as raised:
        await engine.generate(input_ids=[5, 6, 7], **fields).result()
    assert raised.value.field == field and says in str(raised.value), raised.value
    assert (await engine.generate(input_ids=[5, 6, 7], max_new_tokens=2).result()).token_ids


async def test_a_grammar_too_slow_to_compile_is_refused_and_others_are_served(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile past grammar_compile_timeout_s is refused (400 at the doors); its thread
    finishes it in the background (and caches it), while the other compile threads take the
    grammars behind it and every request is served. The schema's compile is held until the
    test lets it go: the tiny vocabulary compiles even a heavy schema about as fast as the
    timeout, on a fast day."""
    compile_ = Grammars.compile
    release, compiled = threading.Event(), threading.Event()

    def held(self: Grammars, spec: GrammarSpec) -> Any:
        if spec.kind != "json_schema":
            return compile_(self, spec)
        assert release.wait(30), "the test never let the compile go"
        try:
            return compile_(self, spec)
        finally:
            compiled.set()

    monkeypatch.setattr(Grammars, "compile", held)
    engine = await make_engine(grammar_compile_timeout_s=0.2)
    schema = heavy_schema(40)
    late = engine.generate(input_ids=[5, 6, 7], json_schema=schema)
    plain = engine.generate(input_ids=[5, 6, 7], max_new_tokens=3)
    beside = engine.generate(input_ids=[5, 6, 7], regex="[a-z]{3}")  # on another thread
    try:
        with pytest.raises(RequestError) as raised:
            await late.result()
        assert raised.value.field == "json_schema"
        assert "grammar_compile_timeout_s" in str(raised.value)
        assert len((await plain.result()).token_ids) == 3
        assert (await beside.result()).finish_reason == "stop"
    finally:
        release.set()
    assert await asyncio.to_thread(compiled.wait, 30)
    again = await engine.generate(
        input_ids=[5, 6, 7], json_schema=schema, max_new_tokens=4
    ).result()
    assert again.finish_reason in ("stop", "length")  # compiled in the background: now cached


@pytest.mark.slow
async def test_every_sampled_output_of_smollm2_matches_its_grammar(
    make_engine: EngineFactory, smollm2: LoadedModel
) -> None:
    """The property above on the bundled model, whose vocabulary is a real one (49,152 byte-
    level tokens, many spanning JSON's punctuation and words together)."""
    engine = await make_engine(smollm2)
    config = smollm2.config
    grammars = Grammars(smollm2.tokenizer, config.vocab_size, config.eos_token_ids, 64 << 20)
    cases = generated_cases(35, 9)
    ask = [{"role": "user", "content": "Answer in the format you are given."}]
    streams = [
        engine.generate(messages=ask, max_new_tokens=96, temperature=(0.7, 1.0, 1.5)[i % 3],
                        seed=i, **{spec.kind: spec.source})
        for i, spec in enumerate(cases)
    ]  # fmt: skip
    done = await asyncio.gather(*(s.result() for s in streams))
    stopped = 0
    for spec, completion in zip(cases, done, strict=True):
        ended = completion.finish_reason == "stop"
        assert matches(grammars, spec, completion.token_ids, ended), (spec, completion.text)
        if ended:
            stopped += 1
            check_text(spec, completion.text)
    assert stopped >= len(cases) // 2, stopped
