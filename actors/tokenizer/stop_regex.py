"""stop_regex (SGLang's): end a request when its output text matches a pattern.

    patterns = StopPatterns(sampling.stop_regex)     # compiled once per request
    hit = patterns.push(text)                        # each chunk of decoded text, as it comes
    if hit is not None: text = text[: hit.keep]      # the match ends the text; hit.pattern

After each chunk (one per token as a rule) every pattern is searched for (`search`: its leftmost
match) over a window: the last WINDOW_CHARS characters of the text before the chunk, and the
chunk. The first chunk after which any pattern matches ends the request; of the patterns that
match then, the one whose match ends first wins (the first given on a tie). The text ends where
the match ends: the match stays in it, as SGLang answers (it never trims a regex's match,
no_stop_trim or not), and whatever the chunk holds past it is dropped (SGLang keeps the rest of
the token that completed the match). A match that ends before the chunk (a lookahead, `\\b`)
keeps none of the chunk.

Nothing is held back for a pattern: the match stays in the text, so text already emitted never
needs taking back. The cost is bounded three ways: patterns per request and characters per
pattern (InputLimits: max_stop_regex, max_stop_regex_chars), the window (a match longer than
it, or starting before it, is not seen), and TIMEOUT_S for one chunk's searches: patterns that
backtrack past it ("(a+)+$" over a run of a's) end their request with an error
(StopRegexTimeout) rather than stall the event loop every other stream shares. A plain
pattern searches the window in tens of microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import regex  # type: ignore[import-untyped]  # no stubs; re's syntax, and search timeouts

WINDOW_CHARS = 1024  # the text before a chunk that each search also covers
TIMEOUT_S = 0.01  # one chunk's searches, every pattern's together


class StopRegexHit(NamedTuple):
    pattern: str  # as given: finish_reason's "matched"
    keep: int  # characters of the chunk the text keeps (up to the match's end)


class StopRegexTimeout(Exception):
    """One chunk's searches ran past the timeout: the request ends with an error (the
    caller's mistake: code invalid_value) naming the pattern searched then."""

    def __init__(self, pattern: str, window_chars: int, timeout_s: float) -> None:
        super().__init__(
            f"stop_regex: searching the last {window_chars} characters of the output took "
            f"longer than {timeout_s * 1000:g} ms (at {pattern!r}); the request was ended: use "
            "patterns that backtrack less"
        )
        self.pattern = pattern


class StopPatterns:
    """One request's stop_regex patterns and the window of its text they are searched over."""

    def __init__(
        self,
        patterns: Sequence[str],
        window_chars: int = WINDOW_CHARS,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        assert patterns, "no patterns: the request has nothing to search for"
        self._compiled = [(pattern, regex.compile(pattern)) for pattern in patterns]
        self._window_chars = window_chars
        self._timeout_s = timeout_s
        self._tail = ""  # the last window_chars characters pushed

    def push(self, text: str) -> StopRegexHit | None:
        """Search the window and this chunk; the hit that ends first, or None (then the chunk
        joins the window). StopRegexTimeout for searches past the timeout together."""
        window = self._tail + text
        best: tuple[int, int] | None = None  # (end in window, index of the pattern)
        deadline = time.monotonic() + self._timeout_s
        for index, (pattern, compiled) in enumerate(self._compiled):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise StopRegexTimeout(pattern, self._window_chars, self._timeout_s)
            try:
                match = compiled.search(window, timeout=left_s)
            except TimeoutError:
                raise StopRegexTimeout(pattern, self._window_chars, self._timeout_s) from None
            if match is not None and (best is None or match.end() < best[0]):
                best = (match.end(), index)
        if best is not None:
            end, index = best
            return StopRegexHit(self._compiled[index][0], max(0, end - len(self._tail)))
        self._tail = window[-self._window_chars :]
        return None
