"""POST /tokenize and /detokenize (SGLang's and vLLM's bodies on one route each), GET
/get_weight_version and GET /model_info."""

from __future__ import annotations

from typing import Any

from served import MODEL, ServeFactory, post, post_ok

from shoal.actors.tokenizer.encode import render_chat


async def test_tokenize_a_prompt_prompts_and_messages(serve: ServeFactory) -> None:
    s = await serve()
    tokenizer = s.engine.tokenizer
    context = s.server.gateway.context_length
    got = await post_ok(s, "/tokenize", {"prompt": "The sea is", "model": MODEL})
    ids = tokenizer.encode("The sea is")
    assert got == {"tokens": ids, "count": len(ids), "max_model_len": context}
    bare = await post_ok(s, "/tokenize", {"prompt": "The sea", "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode("The sea", add_special_tokens=False)
    many = await post_ok(s, "/tokenize", {"prompt": ["a b", "The sea is"]})
    assert many["tokens"] == [tokenizer.encode("a b"), ids] and many["count"] == [
        len(tokenizer.encode("a b")),
        len(ids),
    ]
    messages = [{"role": "user", "content": "hi"}]
    chat = await post_ok(s, "/tokenize", {"messages": messages})
    rendered = render_chat(tokenizer, messages, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    plain = await post_ok(s, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    rendered = render_chat(tokenizer, messages, add_generation_prompt=False)
    assert plain["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


async def test_detokenize_answers_both_names(serve: ServeFactory) -> None:
    s = await serve()
    tokenizer = s.engine.tokenizer
    ids = tokenizer.encode("The sea is deep")
    text = tokenizer.decode(ids, skip_special_tokens=True)
    got = await post_ok(s, "/detokenize", {"tokens": ids, "model": MODEL})
    assert got == {"text": text, "prompt": text}
    many = await post_ok(s, "/detokenize", {"tokens": [ids, ids[:2]]})
    assert many["text"] == [text, tokenizer.decode(ids[:2], skip_special_tokens=True)]
    kept = await post_ok(s, "/detokenize", {"tokens": ids, "skip_special_tokens": False})
    assert kept["text"] == tokenizer.decode(ids, skip_special_tokens=False)


async def test_tokenize_refusals(serve: ServeFactory) -> None:
    s = await serve(max_prompts=2)
    vocab = s.engine.loaded.config.vocab_size if s.engine.loaded else 0
    context = s.server.gateway.context_length

    async def refused(
        path: str, body: dict[str, Any], param: str | None, status: int = 400
    ) -> None:
        got_status, got = await post(s, path, body)
        assert got_status == status and got["error"]["param"] == param, got

    await refused("/detokenize", {"tokens": [1, vocab]}, "tokens")
    await refused("/detokenize", {"tokens": [[1], [-1]]}, "tokens[1]")
    await refused("/detokenize", {"tokens": [0] * (context + 1)}, "tokens")
    await refused("/detokenize", {"tokens": [1, [2]]}, "tokens")
    await refused("/detokenize", {"tokens": [[1], [2], [3]]}, "tokens")  # max_prompts
    await refused("/tokenize", {"prompt": ["a", "b", "c"]}, "prompt")  # max_prompts
    await refused("/tokenize", {}, "prompt")
    both = {"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}
    await refused("/tokenize", both, "prompt")
    await refused(
        "/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"
    )
    await refused(
        "/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"
    )
    await refused("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs")
    await refused("/tokenize", {"prompt": "a", "model": "other"}, "model", 404)


async def test_weight_version_and_model_info(serve: ServeFactory) -> None:
    s = await serve()
    async with s.http.get(s.url + "/get_weight_version") as resp:
        assert resp.status == 200
        got = await resp.json()
    assert got == {"weight_version": str(s.engine.weight_version)}
    async with s.http.get(s.url + "/model_info") as resp:
        alias = await resp.json()
    async with s.http.get(s.url + "/get_model_info") as resp:
        info = await resp.json()
    assert alias == info and alias["weight_version"] == s.engine.weight_version
