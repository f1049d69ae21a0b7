"""Prompt-lookup drafts (issue 35; what asks for them: speculation.py): the tokens that
followed the latest earlier occurrence of a request's last n tokens, for n from `max_n` down
to `min_n`, as llama.cpp's prompt lookup and vLLM's n-gram proposer draft them.

    drafts = NgramDrafts(min_n=1, max_n=4, max_draft=4)
    drafts.extend(prompt_ids)             # then each token as it comes
    proposed = drafts.propose()           # [] when no n-gram of the suffix occurred before
    length, proposed = drafts.match()     # and how many tokens before them agree (<= MATCH_CAP)

Invariants:
- Incremental: `extend` indexes each n-gram once, when its follower arrives (O(max_n) a
  token); `propose` looks up max_n - min_n + 1 keys and copies at most max_draft tokens.
- The suffix itself is never its own match: an n-gram is indexed only once a token follows
  it, so a draft always comes from an occurrence that ended earlier.
- The latest occurrence wins (the most recent context is the likeliest to repeat), and a
  longer n-gram before a shorter one.
- `match` also says how long the agreement is: the n-gram's n, extended backwards past it
  token by token up to MATCH_CAP. The longer it is, the likelier the drafts are kept (on
  SmolLM2's copy and prose answers, the first draft after a match of 1 was kept 14-18% of
  the time, after 4-7 76-100%, after 8 or more 76-98%: bench/README.md), which is what
  speculation.py decides on.
"""

from __future__ import annotations

from collections.abc import Iterable

MATCH_CAP = 16  # a match is measured up to this many tokens


class NgramDrafts:
    def __init__(self, min_n: int = 1, max_n: int = 4, max_draft: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.min_n, self.max_n, self.max_draft = min_n, max_n, max_draft
        self.tokens: list[int] = []
        # n -> n-gram -> the position right after its latest occurrence that has a follower
        self.follows: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }

    def extend(self, token_ids: Iterable[int]) -> None:
        for token in token_ids:
            at = len(self.tokens)  # the new token's position: it follows the n-grams ending before
            for n in range(self.min_n, min(self.max_n, at) + 1):
                self.follows[n][tuple(self.tokens[at - n : at])] = at
            self.tokens.append(token)

    def propose(self) -> list[int]:
        return self.match()[1]

    def match(self) -> tuple[int, list[int]]:
        """(how many tokens up to MATCH_CAP end both here and at the occurrence, its drafts);
        (0, []) when no n-gram of the suffix occurred before."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            at = self.follows[n].get(tuple(tokens[length - n :]))
            if at is not None:
                agree = n  # tokens[at - agree : at] == tokens[length - agree :]
                while (
                    agree < MATCH_CAP
                    and at > agree
                    and tokens[at - agree - 1] == tokens[length - agree - 1]
                ):
                    agree += 1
                return agree, tokens[at : at + self.max_draft]
        return 0, []
