"""actors/scheduler/ngram_drafts.py against a brute-force search: the draft is what followed
the latest earlier occurrence of the longest suffix n-gram that occurred before, and the match's
length: how many tokens before the draft agree with the suffix, up to MATCH_CAP."""

from __future__ import annotations

import random

import pytest

from shoal.actors.scheduler.ngram_drafts import MATCH_CAP, NgramDrafts


def brute(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # an occurrence with a follower
            if tokens[start : start + n] == suffix:
                at = start + n
                agree = max(
                    m
                    for m in range(n, min(MATCH_CAP, at) + 1)
                    if tokens[at - m : at] == tokens[len(tokens) - m :]
                )
                return agree, tokens[at : at + k]
    return 0, []


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 3), (1, 4, 4), (2, 3, 8)])
def test_drafts_equal_a_brute_force_search(min_n: int, max_n: int, k: int) -> None:
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    for _ in range(40):
        vocab = rng.choice([3, 6, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        drafts = NgramDrafts(min_n, max_n, k)
        for cut in range(len(tokens) + 1):  # the prompt, then one token at a time
            if cut:
                drafts.extend([tokens[cut - 1]])
            expected = brute(tokens[:cut], min_n, max_n, k)
            assert drafts.match() == expected, (tokens[:cut],)
            assert drafts.propose() == expected[1]


def test_a_copied_passage_is_drafted_whole() -> None:
    passage = [11, 12, 13, 14, 15, 16, 17]
    drafts = NgramDrafts(1, 3, 4)
    drafts.extend([1, 2, *passage, 3, 4, 11, 12])
    assert drafts.propose() == [13, 14, 15, 16]
    assert drafts.match() == (2, [13, 14, 15, 16])  # 11 12 agree, 4 before them does not
    assert NgramDrafts(1, 3, 4).match() == (0, [])
    long = NgramDrafts(1, 3, 4)
    long.extend(list(range(40)) * 2)  # all 40 agree: the length stops at the cap
    assert long.match() == (MATCH_CAP, [0, 1, 2, 3])


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(0, 2, 1), (3, 2, 1), (1, 2, 0)])
def test_bad_sizes_are_refused(min_n: int, max_n: int, k: int) -> None:
    with pytest.raises(ValueError):
        NgramDrafts(min_n, max_n, k)
