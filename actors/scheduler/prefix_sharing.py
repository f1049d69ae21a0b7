"""Shared prompt prefixes being computed right now: who should wait for whom.

Requests that arrive together with a common prefix would each compute it. Instead, while one
of them computes the prefix (and publishes its full pages to the tree as chunks finish), the
others wait in the queue; admitted afterwards, they match it in the tree and compute only
their own suffix. A waiting request holds back only for a prefix of at least
MIN_SHARED_TOKENS that another request has not yet published.

    publishes = publishes_due(holding, config)         # pages finished since the last plan
    computing = prefixes_in_progress(holding, config)  # prompts being computed now
    if computing.should_wait(candidate.tokens): ...     # skip this round
    computing.add(candidate.tokens, 0)                  # admitted now: others wait for it

Pure Python over token lists; entries are bucketed by their first page, so a candidate is
compared only with prompts that start the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.actors.messages import PublishReq
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req

MIN_SHARED_TOKENS = 32


def shares_prompt(req: Req, config: PlannerConfig) -> bool:
    """Whether req's prompt KV may be offered to others while it runs (sessions keep theirs)."""
    return (
        config.prefix_cache
        and req.session_id is None
        and req.phase in (Phase.PREFILL, Phase.RUNNING)
    )


def publishes_due(holding: list[Req], config: PlannerConfig) -> tuple[PublishReq, ...]:
    """Prompt pages that finished batches computed since the last publish, for the tree
    while their requests run on. Marks them published."""
    ps = config.page_size
    out = []
    for req in holding:
        upto = min(req.num_computed, req.num_prompt)
        if shares_prompt(req, config) and upto // ps > req.num_published // ps:
            out.append(PublishReq(req.rid, tuple(req.tokens[:upto])))
            req.num_published = upto
    return tuple(out)


def prefixes_in_progress(holding: list[Req], config: PlannerConfig) -> PrefixesInProgress | None:
    """The prompts being computed now, or None when nothing is ever shared."""
    if not config.prefix_cache:
        return None
    computing = PrefixesInProgress(config.page_size)
    for req in holding:
        if shares_prompt(req, config):
            computing.add(req.tokens[: req.num_prompt], req.num_published)
    return computing


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
