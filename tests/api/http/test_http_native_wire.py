"""SGLang's native bodies as RL frameworks send them (issue 33, item 1): sampling_params.n on
/generate, and stop_regex on every door. (custom_params and custom_logit_processor are refused
unless they ask for nothing: test_http_fields.py.)"""

from __future__ import annotations

import re
from typing import Any

from served import MODEL, ServeFactory, post, post_ok, sse_events

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


# ---- sampling_params.n ------------------------------------------------------------------------


async def test_n_samples_one_prompt_into_a_list_seeded_seed_plus_i(serve: ServeFactory) -> None:
    s = await serve(max_n=4)
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3}
    got = await post_ok(s, "/generate", {"text": "The sea is", "sampling_params": sampling})
    assert isinstance(got, list) and len(got) == 3
    assert len({g["meta_info"]["id"] for g in got}) == 3
    for i, answer in enumerate(got):
        alone = await s.engine.generate(
            "The sea is", max_new_tokens=6, temperature=1.0, seed=5 + i
        ).result()
        assert answer["output_ids"] == list(alone.token_ids), i
    named = await post_ok(
        s, "/generate", {"text": "Hi", "rid": "r", "sampling_params": {**sampling, "seed": None}}
    )
    assert [g["meta_info"]["id"] for g in named] == ["r-0", "r-1", "r-2"]
    one = await post_ok(s, "/generate", {"text": "Hi", "sampling_params": {"n": 1}})
    assert isinstance(one, dict)  # n 1: one object, as before


async def test_n_over_a_batch_answers_prompt_major(serve: ServeFactory) -> None:
    s = await serve(max_n=4)
    texts = ["Hi", "The sea is very deep and"]
    body = {"text": texts, "sampling_params": [{**GREEDY, "n": 2}, {**GREEDY, "n": 2}]}
    got = await post_ok(s, "/generate", body)
    counts = [g["meta_info"]["prompt_tokens"] for g in got]
    first, second = (len(s.engine.tokenizer.encode(t)) for t in texts)
    assert counts == [first, first, second, second]  # [p0 s0, p0 s1, p1 s0, p1 s1]
    assert got[0]["output_ids"] == got[1]["output_ids"]  # greedy: the samples agree
    assert got[2]["output_ids"] == got[3]["output_ids"]
    one = {**GREEDY, "n": 2}
    ids = [s.engine.tokenizer.encode(t) for t in texts]
    by_ids = await post_ok(s, "/generate", {"input_ids": ids, "sampling_params": one})
    assert [g["output_ids"] for g in by_ids] == [g["output_ids"] for g in got]


async def test_n_refusals(serve: ServeFactory) -> None:
    s = await serve(max_n=2)

    async def refused(body: dict[str, Any], param: str, says: str) -> None:
        status, got = await post(s, "/generate", body)
        assert status == 400, got
        assert got["error"]["param"] == param and says in got["error"]["message"], got

    await refused({"text": "Hi", "sampling_params": {"n": 3}}, "sampling_params.n", "[1, 2]")
    await refused({"text": "Hi", "sampling_params": {"n": 0}}, "sampling_params.n", "got 0")
    mixed = {"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}
    await refused(mixed, "sampling_params.n", "the same n")
    stream = {"text": "Hi", "stream": True, "sampling_params": {"n": 2}}
    await refused(stream, "stream", "one sample")
    async with s.http.post(s.url + "/open_session", json={}) as resp:
        session = (await resp.json())["session_id"]
    turn = {"text": "Hi", "session_params": {"id": session}, "sampling_params": {"n": 2}}
    await refused(turn, "sampling_params.n", "one choice")
    await post_ok(s, "/close_session", {"session_id": session})
    await s.engine.wait_idle(timeout_s=10)


# ---- stop_regex -------------------------------------------------------------------------------


async def full_text(s: Any, prompt: str) -> dict[str, Any]:
    answer: dict[str, Any] = await post_ok(
        s, "/generate", {"text": prompt, "sampling_params": GREEDY}
    )
    return answer


def pattern_in(text: str) -> tuple[str, int]:
    """A pattern (two characters with any one between) that first matches after the text's
    third character, and where that first match ends."""
    for i in range(3, len(text) - 3):
        a, c = text[i], text[i + 2]
        if a.strip() and c.strip():
            pattern = re.escape(a) + "." + re.escape(c)
            match = re.search(pattern, text)
            assert match is not None
            if match.start() >= 3:
                return pattern, match.end()
    raise AssertionError(f"no pattern for {text!r}")


async def test_stop_regex_ends_the_text_with_the_match(serve: ServeFactory) -> None:
    s = await serve()
    full = await full_text(s, "The quick")
    pattern, end = pattern_in(full["text"])
    body = {"text": "The quick", "sampling_params": {**GREEDY, "stop_regex": pattern}}
    got = await post_ok(s, "/generate", body)
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert got["text"] == full["text"][:end]  # the match stays, as SGLang answers
    ids = got["output_ids"]
    assert ids == full["output_ids"][: len(ids)] and len(ids) < len(full["output_ids"])
    kept = {**GREEDY, "stop_regex": [pattern], "no_stop_trim": True}
    again = await post_ok(s, "/generate", {"text": "The quick", "sampling_params": kept})
    assert again["text"] == got["text"] and again["output_ids"] == ids
    never = {**GREEDY, "stop_regex": ["q{9}Z"]}
    whole = await post_ok(s, "/generate", {"text": "The quick", "sampling_params": never})
    assert whole["text"] == full["text"]
    stream = {"text": "The quick", "stream": True, "sampling_params": body["sampling_params"]}
    async with s.http.post(s.url + "/generate", json=stream) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["text"] == got["text"]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


async def test_a_stop_string_ending_first_wins_over_a_pattern(serve: ServeFactory) -> None:
    s = await serve()
    full = await full_text(s, "The quick")
    pattern, end = pattern_in(full["text"])
    stop = full["text"][end - 3 : end - 1]  # ends before the pattern's match
    sampling = {**GREEDY, "stop_regex": pattern, "stop": stop}
    got = await post_ok(s, "/generate", {"text": "The quick", "sampling_params": sampling})
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["text"] == full["text"][: full["text"].index(stop)]


async def test_stop_regex_on_the_openai_doors(serve: ServeFactory) -> None:
    s = await serve()
    full = await full_text(s, "The quick")
    pattern, end = pattern_in(full["text"])
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 24, "temperature": 0}
    got = await post_ok(s, "/v1/completions", {**body, "ignore_eos": True, "stop_regex": pattern})
    assert got["choices"][0]["text"] == full["text"][:end]
    assert got["choices"][0]["finish_reason"] == "stop"


async def test_stop_regex_refusals(serve: ServeFactory) -> None:
    s = await serve(max_stop_regex=2, max_stop_regex_chars=8)

    async def refused(path: str, body: dict[str, Any], param: str, says: str) -> None:
        status, got = await post(s, path, body)
        assert status == 400, got
        assert got["error"]["param"] == param and says in got["error"]["message"], got

    def generate(stop_regex: Any) -> dict[str, Any]:
        return {"text": "Hi", "sampling_params": {"stop_regex": stop_regex}}

    where = "sampling_params.stop_regex"
    await refused("/generate", generate("("), where, "not a valid regular expression")
    await refused("/generate", generate(["a", "a*"]), where, "entry 1 matches the empty text")
    await refused("/generate", generate(["a", "b", "c"]), where, "(max_stop_regex)")
    await refused("/generate", generate("a" * 9), where, "(max_stop_regex_chars)")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_regex": "["}
    await refused("/v1/chat/completions", chat, "stop_regex", "not a valid regular expression")


async def test_a_pattern_that_backtracks_too_long_ends_its_request(serve: ServeFactory) -> None:
    s = await serve()
    a = s.engine.tokenizer.encode("a", add_special_tokens=False)[-1]
    sampling = {
        **{"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        **{"logit_bias": {str(a): 100}, "stop_regex": "(a+a+)+b"},  # exponential over a's
    }
    status, got = await post(s, "/generate", {"text": "Hi", "sampling_params": sampling})
    assert status == 400 and got["error"]["code"] == "invalid_value", got
    assert (
        "'(a+a+)+b'" in got["error"]["message"] and "longer than 10 ms" in got["error"]["message"]
    )
    await post_ok(s, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    await s.engine.wait_idle(timeout_s=10)
