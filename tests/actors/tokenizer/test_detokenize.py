"""actors/tokenizer/detokenize.py and actors/tokenizer/stops.py: streamed text equals the
whole, cut at the stop."""

from __future__ import annotations

import functools
import itertools
import random
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shoal.actors.tokenizer.detokenize import IncrementalDetokenizer, fast_decoder
from shoal.actors.tokenizer.stops import StopMatcher, failure_function

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, 1234567890!",
    "Héllo wörld, ça va? Naïve café, façade, über, señor, smörgåsbord, Ærøskøbing.",
    "日本語のテキストです。中文文本测试。한국어 텍스트도 있어요.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 🚀🚀 and a family 👨‍👩‍👧 at the end.",
]
SAMPLE_TEXT = st.text(alphabet="ab éü日本語😀🎉👍🏽\n.,", max_size=40)


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: few merges, so multi-byte characters span several ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>", "<bos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<eos>",
        bos_token="<bos>",
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Sentencepiece-style: decode drops the leading space of the text's first piece."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def stream(
    detokenizer: IncrementalDetokenizer, ids: Sequence[int], cuts: Sequence[int] = ()
) -> list[str]:
    """Push ids in the chunks that cuts (positions) mark, then flush; all chunks, flush last."""
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    chunks = [detokenizer.push(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*chunks, detokenizer.flush()]


def encode(text: str) -> list[int]:
    return byte_level_tokenizer().encode(text, add_special_tokens=False)


def test_tokenizer_splits_characters() -> None:
    ids = encode("😀")
    assert len(ids) > 1, "the test tokenizer must split an emoji over several ids"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    prompt=st.lists(st.integers(0, 399), max_size=8),
    output=st.lists(st.integers(0, 399), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    skip_special_tokens=st.booleans(),
)
def test_stream_equals_decode_of_random_ids(
    prompt: list[int], output: list[int], cuts: list[int], skip_special_tokens: bool
) -> None:
    tokenizer = byte_level_tokenizer()
    vocab_size = len(tokenizer)
    prompt = [i % vocab_size for i in prompt]
    output = [i % vocab_size for i in output]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    chunks = stream(detokenizer, output, cuts)
    whole = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    assert "".join(chunks) == whole
    assert detokenizer.text == whole
    if "\ufffd" not in whole:
        assert not any("\ufffd" in chunk for chunk in chunks)
    else:
        assert all(not chunk.endswith("\ufffd") for chunk in chunks[:-1])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(prompt=SAMPLE_TEXT, text=SAMPLE_TEXT, cuts=st.lists(st.integers(0, 80), max_size=10))
def test_stream_of_real_text_never_splits_a_character(
    prompt: str, text: str, cuts: list[int]
) -> None:
    ids = encode(text)
    chunks = stream(IncrementalDetokenizer(byte_level_tokenizer(), encode(prompt)), ids, cuts)
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_emoji_come_out_whole() -> None:
    ids = encode("a😀🎉👍🏽b")
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer(), encode("Hi "))
    chunks = stream(detokenizer, ids, range(len(ids)))
    assert "".join(chunks) == "a😀🎉👍🏽b"
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "" in chunks, "ids that complete no character must emit nothing"
    assert "😀" in chunks and "🎉" in chunks


def test_flush_releases_a_broken_tail_as_replacement() -> None:
    ids = encode("x😀")
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer(), [])
    assert detokenizer.push(ids[:-1]) == "x"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "x\ufffd"
    assert detokenizer.flush() == ""


def test_special_tokens_skipped_or_kept() -> None:
    tokenizer = byte_level_tokenizer()
    ids = [*encode("ok"), tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tokenizer, [], True), ids)) == "ok"
    assert "".join(stream(IncrementalDetokenizer(tokenizer, [], False), ids)) == "ok<eos>"


def test_prompt_context_keeps_leading_space() -> None:
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("Hello world", add_special_tokens=False)
    output = tokenizer.encode("the lazy dog", add_special_tokens=False)
    assert tokenizer.decode(output) == "the lazy dog"  # alone, the leading space is gone
    chunks = stream(IncrementalDetokenizer(tokenizer, prompt), output)
    assert "".join(chunks) == " the lazy dog"
    assert "".join(stream(IncrementalDetokenizer(tokenizer, []), output)) == "the lazy dog"


def test_decoding_work_per_push_is_bounded() -> None:
    tokenizer = byte_level_tokenizer()
    ids = encode(" ".join(CORPUS) * 20)
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    detokenizer = IncrementalDetokenizer(CountingTokenizer(), encode("prompt " * 50))
    chunks = stream(detokenizer, ids, range(len(ids)))
    assert "".join(chunks) == tokenizer.decode(ids)
    assert len(ids) > 1000 and max(decoded_lengths) <= 12


# --- stops -------------------------------------------------------------------------------


def run_stops(stops: Sequence[str], pieces: Sequence[str]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    emitted = []
    for piece in pieces:
        out, stop = matcher.push(piece)
        emitted.append(out)
        if stop is not None:
            return "".join(emitted), stop
    return "".join(emitted) + matcher.flush(), None


def reference_stops(stops: Sequence[str], text: str) -> tuple[str, str | None]:
    """The documented rule: earliest end wins, then the longest stop."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if len(s) <= end and text[end - len(s) : end] == s]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_spanning_pushes() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", None)
    assert matcher.push("O") == ("", None)
    assert matcher.push("P and more") == ("", "STOP")
    assert matcher.matched == "STOP"
    with pytest.raises(AssertionError):
        matcher.push("x")


def test_overlapping_stops() -> None:
    assert run_stops(["ab", "b"], ["xab"]) == ("x", "ab")
    assert run_stops(["ab", "b"], ["xa", "b"]) == ("x", "ab")
    assert run_stops(["ab", "b"], ["xcb"]) == ("xc", "b")
    assert run_stops(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", "bc")


def test_earliest_match_wins() -> None:
    assert run_stops(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert run_stops(["zz", "y"], ["..y..zz"]) == ("..", "y")


def test_stop_at_the_very_start() -> None:
    assert run_stops(["<|end|>"], ["<|end|>tail"]) == ("", "<|end|>")
    assert run_stops(["<|end|>"], ["<", "|end", "|>"]) == ("", "<|end|>")


def test_false_prefix_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a STO") == ("a ", None)
    assert matcher.push("RM S") == ("STORM ", None)
    assert matcher.flush() == "S"


def test_no_stops_pass_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("anything") == ("anything", None)
    assert matcher.push("") == ("", None)
    assert matcher.flush() == ""


@settings(max_examples=500, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abc d", max_size=30),
    stops=st.lists(st.text(alphabet="abc d", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stops_match_reference_however_split(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    expected = reference_stops(stops, text)
    assert run_stops(stops, pieces) == expected
    if expected[1] is None:
        assert expected[0] == text


def test_the_documented_examples() -> None:
    assert run_stops(["ab", "b"], ["xab"]) == ("x", "ab")  # both end at 3, the longer wins
    assert run_stops(["abcd", "bc"], ["abcd"]) == ("a", "bc")  # "bc" is whole first


def test_held_back_text_is_the_longest_suffix_that_starts_a_stop() -> None:
    matcher = StopMatcher(["abcab", "cax"])
    assert matcher.push("zzabca") == ("zz", None)  # "abca" starts "abcab" (and "ca", "cax")
    assert matcher.push("b") == ("", "abcab")


def test_a_100k_character_stop_over_a_long_text_is_linear_in_time_and_memory() -> None:
    stop = "a" * 99_999 + "b"  # every proper prefix is a suffix of the text: the worst case
    tracemalloc.start()
    began = time.perf_counter()
    matcher = StopMatcher([stop, "ab" * 50_000])
    emitted = [matcher.push("a" * 5_000)[0] for _ in range(200)]  # 1M characters
    out, matched = matcher.push("b")
    took_s = time.perf_counter() - began
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert matched == stop and len("".join(emitted) + out) == 1_000_000 - 99_999
    assert took_s < 20  # ~0.4 s here; the old prefix set did not finish (5 * 10^9 characters)
    assert peak_bytes < 64 * 2**20  # the failure functions and the held-back text, no more


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(alphabet="ab", min_size=1, max_size=40))
def test_failure_function_matches_its_definition(pattern: str) -> None:
    expected = [
        max(k for k in range(i + 1) if pattern[:k] == pattern[i + 1 - k : i + 1])
        for i in range(len(pattern))
    ]
    assert failure_function(pattern) == expected


def test_the_fast_decoder_decodes_as_the_tokenizer_does(tiny_model: Any) -> None:
    """fast_decoder hands the detokenizer the Rust tokenizer only where it gives transformers'
    text: here, for the tiny model's tokenizer and SmolLM2's kind (no clean-up of spaces),
    on random windows of ids, special tokens kept and skipped."""
    tokenizer = tiny_model.tokenizer
    decoder = fast_decoder(tokenizer)
    assert decoder is tokenizer.backend_tokenizer  # the fast path is taken
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(2000):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode() -> None:
    tokenizer = byte_level_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decoder(tokenizer) is tokenizer
    finally:
        tokenizer.clean_up_tokenization_spaces = False
