"""Stop strings: cut a streamed text at the first stop string, holding back what may start one.

Which occurrence wins: the one that is complete first, i.e. ends earliest in the text (generation
halts the moment a stop string is whole); among stops ending at the same place, the longest.
The output is the text before the winning occurrence, the same however the text is split into
pushes:

    stops ("ab", "b"):    "xab" -> "x", "ab"        both end at 3, the longer wins
    stops ("abcd", "bc"): "abcd" -> "a", "bc"       "bc" is whole before "abcd" is

Invariant between pushes: the held-back text is the longest suffix of everything pushed that is
a proper prefix of some stop string, so no occurrence can straddle emitted and unseen text.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters one request's text stream against its stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "stop strings must be non-empty"
        self._stops = tuple(stops)
        self._max_held = max((len(stop) for stop in self._stops), default=1) - 1
        self._proper_prefixes = frozenset(
            stop[:length] for stop in self._stops for length in range(1, len(stop))
        )
        self._held = ""
        self._finished = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the stop string matched or None).

        On a match the returned text is everything before the stop; the stop and whatever
        follows it are dropped, and the stream is over.
        """
        assert not self._finished and self.matched is None, "push after the stream ended"
        if not self._stops:
            return text, None
        pending = self._held + text
        match = self._first_match(pending)
        if match is not None:
            start, self.matched = match
            self._held, self._finished = "", True
            return pending[:start], self.matched
        num_held = self._held_length(pending)
        cut = len(pending) - num_held
        self._held = pending[cut:]
        return pending[:cut], None

    def flush(self) -> str:
        """Finish without (further) match: release the held-back text."""
        released, self._held, self._finished = self._held, "", True
        return released

    def _first_match(self, pending: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence ending earliest, longest first on ties."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = pending.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_length(self, pending: str) -> int:
        for length in range(min(len(pending), self._max_held), 0, -1):
            if pending[-length:] in self._proper_prefixes:
                return length
        return 0
