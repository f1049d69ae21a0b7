"""actors/tokenizer/byte_detokenize.py and detokenizers.py: a byte-level tokenizer's ids
through its byte table give the Rust decode's text and the old path's, never half a character;
each tokenizer gets its detokenizer."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from unicode_texts import TEXTS

from shoal.actors.tokenizer.byte_detokenize import ByteDetokenizer, ByteTables
from shoal.actors.tokenizer.detokenize import IncrementalDetokenizer, fast_decoder
from shoal.actors.tokenizer.detokenizers import Detokenizer, Detokenizers
from shoal.actors.tokenizer.stream_detokenize import StreamDetokenizer
from shoal.loading.hf_tokenizer import HFTokenizer

VOCAB = 49152  # SmolLM2's


def rust(tokenizer: HFTokenizer) -> Tokenizer:
    decoder = fast_decoder(tokenizer)
    assert isinstance(decoder, Tokenizer)
    return decoder


def tables(tokenizer: Tokenizer) -> ByteTables:
    found = ByteTables.of(tokenizer)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def smollm2_tables(smollm2_tokenizer: HFTokenizer) -> ByteTables:
    return tables(rust(smollm2_tokenizer))


def byte_detok(found: ByteTables, skip_special_tokens: bool) -> ByteDetokenizer:
    return ByteDetokenizer(found.skip if skip_special_tokens else found.keep)


def chunks(detok: Detokenizer, ids: Sequence[int], cuts: Sequence[int]) -> list[str]:
    """Push ids in the pieces that cuts mark, then flush; every chunk, the flush last."""
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    return [*(detok.push(ids[a:b]) for a, b in itertools.pairwise(bounds)), detok.flush()]


def test_every_ids_bytes_are_what_rust_decodes(smollm2_tokenizer: HFTokenizer) -> None:
    decoder = rust(smollm2_tokenizer)
    found = tables(decoder)
    assert len(found.keep) == len(found.skip) == VOCAB
    for i in range(VOCAB):
        for table, skip in ((found.keep, False), (found.skip, True)):
            whole = table[i].decode("utf-8", errors="replace")
            assert whole == decoder.decode([i], skip_special_tokens=skip), i
    assert found.keep[2] == b"<|im_end|>" and found.skip[2] == b""


def test_an_added_token_outside_the_byte_alphabet_is_its_own_text() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(["hello world", "ĠĠ"])
    tokenizer.add_special_tokens(["<é end>"])
    found = tables(tokenizer)
    for ids in ([0], [1], [2], [0, 1, 2, 1]):
        for table, skip in ((found.keep, False), (found.skip, True)):
            text = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
            assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=30),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    skip_special_tokens=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_ids_give_the_rust_decode_and_the_old_text(
    smollm2_tokenizer: HFTokenizer,
    smollm2_tables: ByteTables,
    prompt: list[int],
    output: list[int],
    cuts: list[int],
    skip_special_tokens: bool,
    seed: int,
) -> None:
    """Special ids, lone bytes of characters, ids past the vocabulary (no text) among them:
    the text is decode(output ids), the old path's after any prompt; a chunk holds U+FFFD
    only where that text does."""
    decoder = rust(smollm2_tokenizer)
    rng = random.Random(seed)
    output += rng.choices(range(3), k=2) + rng.choices(range(200, 260), k=4) + [VOCAB + 7]
    rng.shuffle(output)
    new = chunks(byte_detok(smollm2_tables, skip_special_tokens), output, cuts)
    whole = decoder.decode(output, skip_special_tokens=skip_special_tokens)
    old = IncrementalDetokenizer(decoder, prompt, skip_special_tokens)
    assert "".join(new) == whole == "".join(chunks(old, output, cuts))
    if "\ufffd" not in whole:
        assert not any("\ufffd" in chunk for chunk in new)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_real_text_one_id_at_a_time_comes_out_no_later_than_before(
    smollm2_tokenizer: HFTokenizer, smollm2_tables: ByteTables, text: str, skip_special_tokens: bool
) -> None:
    """After each id, the text so far extends the old path's (which held back a space before
    a split character until the character was whole) and never splits a character."""
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode(text).ids
    every = range(len(ids))
    new = chunks(byte_detok(smollm2_tables, skip_special_tokens), ids, every)
    prompt = decoder.encode("Say something: ").ids
    old = chunks(IncrementalDetokenizer(decoder, prompt, skip_special_tokens), ids, every)
    whole = decoder.decode(ids, skip_special_tokens=skip_special_tokens)
    so_far_new, so_far_old = itertools.accumulate(new), itertools.accumulate(old)
    for mine, before in zip(so_far_new, so_far_old, strict=True):
        assert mine.startswith(before) and whole.startswith(mine)
    assert "".join(new) == whole and not any("\ufffd" in chunk for chunk in new)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 60), max_size=12))
def test_pushes_of_several_ids_never_split_a_character(
    smollm2_tokenizer: HFTokenizer, smollm2_tables: ByteTables, text: str, cuts: list[int]
) -> None:
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode(text).ids
    new = chunks(byte_detok(smollm2_tables, False), ids, cuts)
    assert "".join(new) == text and not any("\ufffd" in chunk for chunk in new)


def test_a_split_character_comes_out_whole_and_a_broken_tail_as_replacement(
    smollm2_tokenizer: HFTokenizer,
    smollm2_tables: ByteTables,
) -> None:
    decoder = rust(smollm2_tokenizer)
    ids = decoder.encode("x😀").ids
    assert len(ids) == 4, "the emoji must span three ids"
    assert chunks(byte_detok(smollm2_tables, True), ids, range(4)) == ["x", "", "", "😀", ""]
    broken = byte_detok(smollm2_tables, True)
    assert [broken.push([i]) for i in ids[:-1]] == ["x", "", ""]
    assert broken.flush() == "\ufffd" and broken.flush() == ""


def test_each_tokenizer_gets_its_detokenizer(smollm2_tokenizer: HFTokenizer) -> None:
    """Byte-level Rust: the tables; other Rust: the streaming decoder; a tokenizer that
    decodes its own way (clean-up of spaces): the old path."""
    assert isinstance(Detokenizers(smollm2_tokenizer).open([1], True), ByteDetokenizer)
    metaspace = Tokenizer(models.WordLevel({"<unk>": 0, "▁a": 1}, unk_token="<unk>"))
    metaspace.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=metaspace, clean_up_tokenization_spaces=False)
    assert isinstance(Detokenizers(fast).open([1], True), StreamDetokenizer)
    fast.clean_up_tokenization_spaces = True
    assert isinstance(Detokenizers(fast).open([1], True), IncrementalDetokenizer)
    assert ByteTables.of(metaspace) is None
