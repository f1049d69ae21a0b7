"""actors/tokenizer/stream_detokenize.py: the streaming decoder gives the old path's text,
chunk for chunk when ids come one at a time, on SmolLM2's tokenizer (its Rust tokenizer taken
as any, though detokenizers.py gives it the byte tables) and on a sentencepiece-style one."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from unicode_texts import TEXTS

from shoal.actors.tokenizer.detokenize import IncrementalDetokenizer, fast_decoder
from shoal.actors.tokenizer.detokenizers import Detokenizer
from shoal.actors.tokenizer.stream_detokenize import StreamDetokenizer
from shoal.loading.hf_tokenizer import HFTokenizer


def rust(tokenizer: HFTokenizer) -> Tokenizer:
    decoder = fast_decoder(tokenizer)
    assert isinstance(decoder, Tokenizer), "SmolLM2's tokenizer takes the Rust path"
    return decoder


def chunks(detok: Detokenizer, ids: Sequence[int], cuts: Sequence[int]) -> list[str]:
    """Push ids in the pieces that cuts mark, then flush; every chunk, the flush last."""
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    return [*(detok.push(ids[a:b]) for a, b in itertools.pairwise(bounds)), detok.flush()]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    prompt=st.lists(st.integers(0, 49151), max_size=8),
    output=st.lists(st.integers(0, 49151), max_size=30),
    skip_special_tokens=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_id_at_a_time_gives_the_old_chunks_on_random_ids(
    smollm2_tokenizer: HFTokenizer,
    prompt: list[int],
    output: list[int],
    skip_special_tokens: bool,
    seed: int,
) -> None:
    """Random ids (special ids and lone bytes of characters among them): the same chunk per
    push and at the flush as IncrementalDetokenizer, so the same text."""
    decoder = rust(smollm2_tokenizer)
    rng = random.Random(seed)
    output += rng.choices(range(3), k=2) + rng.choices(range(200, 260), k=4)  # specials, bytes
    rng.shuffle(output)
    every = range(len(output))
    new = chunks(StreamDetokenizer(decoder, prompt, skip_special_tokens), output, every)
    old = chunks(IncrementalDetokenizer(decoder, prompt, skip_special_tokens), output, every)
    assert new == old
    assert "".join(new) == decoder.decode(output, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_real_text_comes_out_whole_and_as_before(
    smollm2_tokenizer: HFTokenizer, text: str, skip_special_tokens: bool
) -> None:
    decoder = rust(smollm2_tokenizer)
    prompt = decoder.encode("Say something: ").ids
    ids = decoder.encode(text).ids
    every = range(len(ids))
    new = chunks(StreamDetokenizer(decoder, prompt, skip_special_tokens), ids, every)
    old = chunks(IncrementalDetokenizer(decoder, prompt, skip_special_tokens), ids, every)
    assert new == old
    assert "".join(new) == decoder.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in chunk for chunk in new)
    if not skip_special_tokens and "<|im_end|>" in text:
        assert "".join(new).count("<|im_end|>") == 1


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    text=st.sampled_from(TEXTS),
    cuts=st.lists(st.integers(0, 60), max_size=12),
    skip_special_tokens=st.booleans(),
)
def test_pushes_of_several_ids_give_the_same_text(
    smollm2_tokenizer: HFTokenizer, text: str, cuts: list[int], skip_special_tokens: bool
) -> None:
    """A push of several ids may end inside a character: it waits for the rest (the old path
    emitted up to its last whole character); the text is the same, never half a character."""
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode(text).ids
    new = chunks(StreamDetokenizer(decoder, [], skip_special_tokens), ids, cuts)
    old = chunks(IncrementalDetokenizer(decoder, [], skip_special_tokens), ids, cuts)
    assert (
        "".join(new) == "".join(old) == decoder.decode(ids, skip_special_tokens=skip_special_tokens)
    )
    assert not any("\ufffd" in chunk for chunk in new)


def test_a_character_split_over_ids_comes_out_once_it_is_whole(
    smollm2_tokenizer: HFTokenizer,
) -> None:
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode("a😀").ids
    assert len(ids) > 2, "the emoji must span several ids"
    detok = StreamDetokenizer(decoder, decoder.encode("Hi ").ids, True)
    out = [detok.push(ids[i : i + 1]) for i in range(len(ids))]
    assert out == ["a", *[""] * (len(ids) - 2), "😀"]
    broken = StreamDetokenizer(decoder, [], True)
    assert broken.push(ids[:-1]) == ""  # "a" and two bytes of the emoji: nothing whole yet
    assert broken.flush() == "a\ufffd" == decoder.decode(ids[:-1])
    assert broken.flush() == ""


def test_a_broken_tail_flushes_as_replacement(smollm2_tokenizer: HFTokenizer) -> None:
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode("x😀").ids
    detok = StreamDetokenizer(decoder, [], True)
    assert [detok.push([i]) for i in ids[:-1]] == ["x", "", ""]
    assert detok.flush() == "\ufffd"
    old = IncrementalDetokenizer(decoder, [], True)
    assert [old.push([i]) for i in ids[:-1]] == ["x", "", ""] and old.flush() == "\ufffd"


def test_a_prompt_ending_inside_a_character_is_not_completed(
    smollm2_tokenizer: HFTokenizer,
) -> None:
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode("x😀").ids
    detok = StreamDetokenizer(decoder, ids[:-1], True)
    old = IncrementalDetokenizer(decoder, ids[:-1], True)
    assert chunks(detok, ids[-1:], [1]) == chunks(old, ids[-1:], [1])
    assert "😀" not in "".join(chunks(StreamDetokenizer(decoder, ids[:-1], True), ids[-1:], []))


def test_prompt_context_keeps_the_leading_space() -> None:
    """Sentencepiece-style: the first output token decodes after the prompt's last ids."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁the": 3, "▁dog": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="always")
    assert tokenizer.decode([3, 4]) == "the dog"  # alone, the leading space is gone
    assert "".join(chunks(StreamDetokenizer(tokenizer, [1, 2], True), [3, 4], [1])) == " the dog"
    assert "".join(chunks(StreamDetokenizer(tokenizer, [], True), [3, 4], [1])) == "the dog"


def test_a_rule_across_tokens_falls_back_to_the_old_path() -> None:
    """A decoder that rewrites text already emitted (a Replace after Fuse) makes DecodeStream
    fail; the request goes on through IncrementalDetokenizer, chunk for chunk as before."""
    vocab = {"a": 0, "b": 1, "c": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    ids = [2, 0, 1, 2, 0, 0, 1]
    every = range(len(ids))
    new = chunks(StreamDetokenizer(tokenizer, [2], True), ids, every)
    assert new == chunks(IncrementalDetokenizer(tokenizer, [2], True), ids, every)


def llama2_style_tokenizer() -> Tokenizer:
    """Sentencepiece with byte fallback, decoded as Llama 2's tokenizer.json does: a character
    outside the vocabulary comes as its UTF-8 bytes, one id each."""
    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁dog", "▁", "a", "é", "▁日"]
    pieces += [f"<0x{b:02X}>" for b in (0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80, 0x20)]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, "<unk>"))
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    prompt=st.lists(st.integers(0, 16), max_size=6),
    output=st.lists(st.integers(0, 16), max_size=30),
    skip_special_tokens=st.booleans(),
)
def test_a_sentencepiece_tokenizer_gives_the_old_chunks(
    prompt: list[int], output: list[int], skip_special_tokens: bool
) -> None:
    """Leading spaces, special tokens and characters split over byte-fallback ids: the same
    chunk per push and at the flush as IncrementalDetokenizer."""
    tokenizer = llama2_style_tokenizer()
    every = range(len(output))
    new = chunks(StreamDetokenizer(tokenizer, prompt, skip_special_tokens), output, every)
    old = chunks(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens), output, every)
    assert new == old


def test_byte_fallback_ids_of_one_character_come_out_together() -> None:
    tokenizer = llama2_style_tokenizer()
    ids = [3, 5, 9, 10, 11, 6]  # "▁the", "▁", 日 as three bytes, "a"
    out = chunks(StreamDetokenizer(tokenizer, [4], True), ids, range(len(ids)))
    assert out == [" the", " ", "", "", "日", "a", ""]
