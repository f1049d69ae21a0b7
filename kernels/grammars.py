"""Grammars compiled by xgrammar for the model's vocabulary: what a request's json_schema,
regex, ebnf or structural_tag (params.GrammarSpec) becomes, and the matchers its row walks.

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids, cache_bytes)
    grammars.compile(spec)      # RequestError naming the field when the source is not valid
    matcher = grammars.matcher(spec)                                   # one per row

Invariants:
- Compiling is thread-safe and releases the GIL (xgrammar's C++): the tokenizer actor runs it
  on a thread of its own with a deadline (actors/tokenizer/intake.py), never on the event loop.
- Compiled grammars stay in xgrammar's cache, keyed by kind and source and bounded in bytes
  (least recently used dropped first), so a row's matcher (the executor's RowInit, after the
  request's compile at the door) is a cache hit; an evicted one compiles again, the same.
- A matcher's stop tokens are the model's EOS ids (what the scheduler ends a request on), so
  a grammar that is complete lets the row end there and nowhere else.
- xgrammar is imported on the first compile (3 s), so a server that never sees a grammar
  never pays for it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal.params import GrammarSpec
from shoal.results import RequestError

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors lead with a time and a source line, and some with the failed check:
# "[11:42:32] /project/cpp/regex_converter.cc:83: Regex parsing error at ..."
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class Grammars:
    """The compiler of one engine's model: its tokenizer's vocabulary (`tokenizer`, a
    transformers tokenizer; `vocab_size`, the width of the model's logits) and stop tokens.
    A JSON schema's output is compact JSON (", " and ": " between items, no other
    whitespace) unless `any_whitespace`, which lets the model put whitespace wherever JSON
    allows it (xgrammar's and vLLM's default; a weak model may then loop on newlines)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_bytes: int,
        any_whitespace: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_bytes = cache_bytes
        self.any_whitespace = any_whitespace
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None

    @property
    def is_ready(self) -> bool:
        return self._compiler is not None

    def ready(self) -> None:
        """Import xgrammar and build the vocabulary's tables, once (a first grammar's cost,
        which its compile timeout should not count)."""
        self._compiler_()

    def _compiler_(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=self.cache_bytes
                )
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The grammar `spec` asks for (from the cache when compiled before): RequestError
        naming spec.kind when its source does not compile."""
        compiler = self._compiler_()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source, any_whitespace=self.any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors are these
            lines = _NOISE.sub("", str(exc)).strip().splitlines()
            reason = lines[0] if lines else "xgrammar failed an internal check on it"
            raise RequestError(f" could not be compiled: {reason}", spec.kind, named=True) from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def matcher(self, spec: GrammarSpec) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar, ending on the model's EOS ids."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=self.stop_token_ids)
