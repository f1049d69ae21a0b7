"""kernels/grammars.py: what each grammar field compiles to over the tiny tokenizer, the
refusals (naming the field, without xgrammar's source lines), the cache, the matcher's end on
the model's EOS ids, and a compile that lets other Python threads run (it releases the GIL,
so the event loop keeps answering while one runs on the compile thread)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from grammar_cases import heavy_schema, tiny_grammars
from tiny_model import EOS_ID, make_tiny_tokenizer

from shoal.kernels.grammars import Grammars
from shoal.params import GrammarSpec
from shoal.results import RequestError


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return tiny_grammars(make_tiny_tokenizer())


def test_each_kind_compiles_and_its_matcher_ends_on_eos(grammars: Grammars) -> None:
    tokenizer = grammars.tokenizer
    cases = {
        "json_schema": ('{"type": "object", "properties": {"a": {"type": "integer"}}}', '{"a": 1}'),
        "regex": ("[a-z]+-[0-9]{2}", "abc-42"),
        "ebnf": ('root ::= "yes" | "no"', "no"),
        "structural_tag": (
            '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}', "hi"
        ),
    }  # fmt: skip
    for kind, (source, text) in cases.items():
        matcher = grammars.matcher(GrammarSpec(kind, source))
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), (kind, text)
        assert matcher.accept_token(EOS_ID) and matcher.is_terminated(), kind


@pytest.mark.parametrize(
    ("kind", "source", "says"),
    [
        ("regex", "((", "Regex parsing error at position 3: The parenthesis is not closed."),
        ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("structural_tag", '{"a": 1}', "Structural tag must have a format field"),
    ],
)
def test_a_source_that_does_not_compile_is_refused_naming_its_field(
    grammars: Grammars, kind: str, source: str, says: str
) -> None:
    with pytest.raises(RequestError) as raised:
        grammars.compile(GrammarSpec(kind, source))
    assert raised.value.field == kind
    message = str(raised.value)
    assert says in message and ".cc:" not in message and "Check failed" not in message, message


def test_a_compiled_grammar_comes_from_the_cache(grammars: Grammars) -> None:
    spec = GrammarSpec("json_schema", heavy_schema(30))
    first = time.perf_counter()
    grammars.compile(spec)
    once = time.perf_counter() - first
    again = time.perf_counter()
    grammars.compile(spec)
    assert time.perf_counter() - again < once / 10


def test_a_compile_lets_other_threads_run(grammars: Grammars) -> None:
    """A ticker thread sleeping 1 ms at a time keeps ticking while a heavy schema compiles
    (with the GIL held it would tick once or twice at most)."""
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    try:
        grammars.compile(GrammarSpec("json_schema", heavy_schema(120)))
    finally:
        done.set()
        ticker.join()
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert elapsed_ms > 50, elapsed_ms  # heavy enough to tell
    assert ticks[0] > elapsed_ms / 10, (ticks[0], elapsed_ms)


@pytest.mark.gpu
def test_a_rows_mask_on_cuda_equals_its_mask_on_the_cpu(grammars: Grammars) -> None:
    """GrammarRow's bitmask goes to the logits' device: the same bans on CUDA as on the CPU,
    applied to one row of a batch and not its neighbours."""
    import torch

    from shoal.kernels.grammar_row import GrammarRow

    spec = GrammarSpec("json_schema", heavy_schema(3))
    logits = torch.randn(3, 512)
    banned = {}
    for device in ("cpu", "cuda"):
        row = GrammarRow(grammars.matcher(spec), 512, torch.device(device))
        batch = logits.to(device)
        for token in grammars.tokenizer.encode('{"f0": [', add_special_tokens=False):
            assert row.advance(token) is None
        row.mask_(batch[1])
        banned[device] = torch.isinf(batch).cpu()
    assert torch.equal(banned["cpu"], banned["cuda"])
    assert banned["cpu"][1].any() and not banned["cpu"][0].any() and not banned["cpu"][2].any()


class _RandomMatcher:
    """A matcher whose every mask is random bits (for the host path's byte table)."""

    def __init__(self, seed: int) -> None:
        import torch

        self.gen = torch.Generator().manual_seed(seed)

    def fill_next_token_bitmask(self, bitmask: Any) -> None:
        import torch

        bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=self.gen,
                                    dtype=torch.int32))  # fmt: skip

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("vocab", [512, 1000, 49152])
def test_the_host_mask_bans_what_xgrammars_kernel_bans(vocab: int) -> None:
    """GrammarRow's host path (each bitmask byte through a table of 0 and -inf, added to the
    logits) equals xgrammar's own apply, at vocabularies that fill their last word or not."""
    import torch
    import xgrammar

    from shoal.kernels.grammar_row import GrammarRow

    row = GrammarRow(_RandomMatcher(vocab), vocab, torch.device("cpu"))  # type: ignore[arg-type]
    for _ in range(3):
        logits = torch.randn(2, vocab)
        want = logits[1:].clone()
        row.mask_(logits[1])
        xgrammar.apply_token_bitmask_inplace(want, row.bitmask, vocab_size=vocab)
        assert torch.equal(logits[1:], want)
        assert torch.isinf(logits[1]).any() and not torch.isinf(logits[0]).any()
