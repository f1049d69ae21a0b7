"""Shared prompt prefixes being computed right now: who should wait for whom.

Requests that arrive together with a common prefix would each compute it. Instead, while one
of them computes the prefix (and publishes its full pages to the tree as chunks finish), the
others wait in the queue; admitted afterwards, they match it in the tree and compute only
their own suffix. A waiting request holds back only for a prefix of at least
MIN_SHARED_TOKENS that another request has not yet published.

    computing = PrefixesInProgress(page_size)
    computing.add(running.prompt, running.num_published)   # each request computing a prompt
    if computing.should_wait(candidate.prompt): ...         # skip this round
    computing.add(candidate.prompt, 0)                      # admitted now: others wait for it

Pure Python over token lists; entries are bucketed by their first page, so a candidate is
compared only with prompts that start the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_SHARED_TOKENS = 32


class PrefixesInProgress:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.by_first_page: dict[tuple[int, ...], list[tuple[Sequence[int], int]]] = {}

    def add(self, prompt: Sequence[int], num_published: int) -> None:
        if len(prompt) >= max(self.page_size, MIN_SHARED_TOKENS):
            key = tuple(prompt[: self.page_size])
            self.by_first_page.setdefault(key, []).append((prompt, num_published))

    def should_wait(self, prompt: Sequence[int]) -> bool:
        """Whether another request is computing a long prefix of `prompt` (what admission can
        match: full pages of all but its last token) and has not published it yet."""
        query = prompt[: max(len(prompt) - 1, 0)]
        if len(query) < max(self.page_size, MIN_SHARED_TOKENS):
            return False
        for other, num_published in self.by_first_page.get(tuple(query[: self.page_size]), ()):
            shared = _common_prefix_len(query, other) // self.page_size * self.page_size
            if shared >= MIN_SHARED_TOKENS and shared > num_published:
                return True
        return False


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
