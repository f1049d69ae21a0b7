"""stop_regex's matcher (actors/tokenizer/stop_regex.py): which pattern wins, where the text
ends, the window it searches, and the timeout that bounds a pattern that backtracks."""

from __future__ import annotations

import pytest

from shoal.actors.tokenizer.stop_regex import StopPatterns, StopRegexHit, StopRegexTimeout
from shoal.params import SamplingParams
from shoal.results import RequestError


def test_a_match_across_chunks_ends_the_text_where_it_ends() -> None:
    patterns = StopPatterns([r"c\d"])
    assert patterns.push("ab") is None
    assert patterns.push("c") is None
    assert patterns.push("12x") == StopRegexHit(r"c\d", 1)  # the chunk keeps "1": "c1" ends


def test_the_match_that_ends_first_wins_and_the_first_given_on_a_tie() -> None:
    assert StopPatterns(["xyz", "y"]).push("axyz") == StopRegexHit("y", 3)
    assert StopPatterns(["b+", "ab"]).push("abbb") == StopRegexHit("ab", 2)
    assert StopPatterns(["ab", "b"]).push("ab") == StopRegexHit("ab", 2)  # both end at 2


def test_a_match_ending_before_the_chunk_keeps_none_of_it() -> None:
    patterns = StopPatterns([r"a(?=b)"])  # complete only once "b" is seen
    assert patterns.push("xa") is None
    assert patterns.push("bc") == StopRegexHit(r"a(?=b)", 0)


def test_the_search_covers_the_window_and_the_chunk_only() -> None:
    patterns = StopPatterns(["a{6}X"], window_chars=4)
    assert patterns.push("a" * 10) is None
    assert patterns.push("X") is None  # the six a's started before the window
    patterns = StopPatterns(["a{4}X"], window_chars=4)
    assert patterns.push("a" * 10) is None
    assert patterns.push("X") == StopRegexHit("a{4}X", 1)


def test_a_pattern_that_backtracks_past_the_timeout_raises_naming_it() -> None:
    patterns = StopPatterns(["plain", "(x+x+)+y"])  # exponential over a run of x's
    with pytest.raises(StopRegexTimeout) as caught:
        patterns.push("x" * 2000)
    assert caught.value.pattern == "(x+x+)+y"
    assert "longer than 10 ms" in str(caught.value)


@pytest.mark.parametrize(
    ("patterns", "says"),
    [
        (("(",), "stop_regex is not a valid regular expression: missing )"),
        (("ok", "[z-a]"), "stop_regex entry 1 is not a valid regular expression"),
        (("a*",), "stop_regex matches the empty text"),
        (("$",), "stop_regex matches the empty text"),
    ],
)
def test_validate_refuses_a_pattern_that_does_not_compile_or_matches_nothing(
    patterns: tuple[str, ...], says: str
) -> None:
    with pytest.raises(RequestError) as caught:
        SamplingParams(stop_regex=patterns).validate()
    assert caught.value.field == "stop_regex" and str(caught.value).startswith(says)
    SamplingParams(stop_regex=("a+", r"\n\n")).validate()
