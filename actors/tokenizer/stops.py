"""Stop strings: cut a streamed text at the first stop string, holding back what may start one.

Which occurrence wins: the one that is complete first, i.e. ends earliest in the text (generation
halts the moment a stop string is whole); among stops ending at the same place, the longest.
The output is the text before the winning occurrence, the same however the text is split into
pushes:

    stops ("ab", "b"):    "xab" -> "x", "ab"        both end at 3, the longer wins
    stops ("abcd", "bc"): "abcd" -> "a", "bc"       "bc" is whole before "abcd" is

Invariant between pushes: the held-back text is the longest suffix of everything pushed that is
a proper prefix of some stop string, so no occurrence can straddle emitted and unseen text.

How: one Knuth-Morris-Pratt automaton per stop string. Its state is the length of the longest
prefix of the stop that is a suffix of everything pushed; it reaches len(stop) exactly where an
occurrence ends, and the held-back length is the largest state. The failure function is built
once per stop (O(len(stop)) time and memory) and each pushed character advances each automaton
in amortized O(1), so matching is linear in the text and the stops; nothing is ever rescanned.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters one request's text stream against its stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "stop strings must be non-empty"
        self._automata = [StopAutomaton(stop) for stop in stops]
        self._held = ""
        self._finished = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the stop string matched or None).

        On a match the returned text is everything before the stop; the stop and whatever
        follows it are dropped, and the stream is over.
        """
        assert not self._finished and self.matched is None, "push after the stream ended"
        if not self._automata:
            return text, None
        pending = self._held + text
        best: tuple[int, int, str] | None = None  # (end in pending, -len, stop)
        for automaton in self._automata:
            end_in_text = automaton.advance(text)
            if end_in_text is not None:
                stop = automaton.stop
                candidate = (len(self._held) + end_in_text, -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, _, self.matched = best
            self._held, self._finished = "", True
            return pending[: end - len(self.matched)], self.matched
        num_held = max(automaton.state for automaton in self._automata)
        cut = len(pending) - num_held
        self._held = pending[cut:]
        return pending[:cut], None

    def flush(self) -> str:
        """Finish without (further) match: release the held-back text."""
        released, self._held, self._finished = self._held, "", True
        return released


class StopAutomaton:
    """KMP over one stop string: `state` is the length of the longest prefix of the stop that
    is a suffix of all the text advanced over (always < len(stop) between matches)."""

    def __init__(self, stop: str) -> None:
        assert stop, "a stop string must be non-empty"
        self.stop = stop
        self.failure = failure_function(stop)
        self.state = 0

    def advance(self, text: str) -> int | None:
        """Run over text; the index in text just past the first complete occurrence (the
        state is then len(stop)), or None with the state updated to the end of text."""
        stop, failure, state = self.stop, self.failure, self.state
        first, length = stop[0], len(stop)
        i, size = 0, len(text)
        while i < size:
            if state == 0:  # skip to the next possible start at C speed
                i = text.find(first, i)
                if i < 0:
                    break
                state, i = 1, i + 1
            else:
                char = text[i]
                while state and stop[state] != char:
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
                i += 1
            if state == length:
                self.state = state
                return i
        self.state = state
        return None


def failure_function(pattern: str) -> list[int]:
    """failure[i]: the length of the longest proper prefix of pattern[: i + 1] that is also
    its suffix (the classic KMP prefix function)."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        char = pattern[i]
        while k and pattern[k] != char:
            k = failure[k - 1]
        if pattern[k] == char:
            k += 1
        failure[i] = k
    return failure
