"""Which decodes speculate, and with what drafts (issue 35): plain Python, no asyncio, no torch.

A speculating decode launches its row's last token and k drafted ones as one chunk of 1 + k
positions; the executor keeps the longest prefix of drafts its target agrees with and one more
token (actors/executor/draft_asks.py), so a step emits 1 .. k + 1 tokens for the row.

    spec = Speculation(SpecConfig(...))
    spec.active(num_running)         # this step may speculate: few enough rows decode
    draft = spec.draft(req, num_running)  # its next decode's drafts; (): none; None: wait
    spec.verified(req, k, accepted)  # its result: the row's backoff, the counters

Switched by load: a step speculates only while at most `max_batch` requests run (a bigger
batch already reads each weight once for many rows); a row speculates only when it has caught
up (no token of it on its way: drafts need its last token) and its sampling edits nothing a
draft would need per position (`drafts_allowed`). Per row, what its drafts paid decides:
it sends as many drafts as each has a chance above a draft's cost of being kept with those
before it (`RowDrafts.length`: 2 at first, up to `num_draft_tokens`; the cost is DRAFT_COST
alone and more with more rows decoding: `draft_cost`), and a verification that kept nothing,
or a chance below the cost for even one draft, makes it wait 1, 2, 4 .. `MAX_BACKOFF`
decodes before it drafts again (one draft then, to learn again). A row about to
draft waits for its tokens on their way (no overlap: `draft` answers None); one that skips
decodes overlapped as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.actors.scheduler.ngram_drafts import NgramDrafts
from shoal.actors.scheduler.request import Req
from shoal.params import SamplingParams

MAX_BACKOFF = 16
# What one draft position adds to a decode's step, as a share of it (a CPU step of SmolLM2
# verifying 4 drafts: 1.26x a decode in float32, 1.66x in int8): a draft is worth sending
# while the chance that it and those before it are kept is above this.
DRAFT_COST = 0.15
KEEP_MEMORY = 0.8  # how much of a row's earlier verifications its estimate keeps


def draft_cost(decoding: int) -> float:
    """What a draft position costs as a share of a token's time, `decoding` rows running: a
    step of M rows costs about 1 + DRAFT_COST (M - 1) one-row steps and makes M tokens, so a
    draft, DRAFT_COST of a one-row step, is DRAFT_COST M / (1 + DRAFT_COST (M - 1)) of a
    token's time: DRAFT_COST at one row, 0.41 at 4, 0.59 at 8."""
    rows = max(1, decoding)
    return DRAFT_COST * rows / (1.0 + DRAFT_COST * (rows - 1))


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 8  # drafts verified per row and step at most
    min_n: int = 1  # the n-gram sizes looked up, longest first
    max_n: int = 4
    max_batch: int = 8  # a step with more running requests does not speculate


def drafts_allowed(sampling: SamplingParams) -> bool:
    """Whether a request's sampling lets it speculate: nothing in its row's sampling depends
    on its earlier tokens or is reported per token (penalties, logit_bias, a grammar,
    logprobs, routed experts); its min_new_tokens mask is checked per step (`Speculation`)."""
    return (
        sampling.repetition_penalty == 1.0
        and sampling.frequency_penalty == 0.0
        and sampling.presence_penalty == 0.0
        and not sampling.logit_bias
        and sampling.grammar is None
        and not sampling.wants_logprobs
        and not sampling.return_routed_experts
    )


@dataclass
class RowDrafts:
    """One request's n-gram index over its tokens so far and its acceptance backoff."""

    ngrams: NgramDrafts
    indexed: int = 0  # tokens of the request given to `ngrams`
    skip: int = 0  # decodes left before it drafts again
    backoff: int = 1  # the next wait after a verification that kept nothing
    # drafts kept and verifications that refused one, decayed by KEEP_MEMORY each time:
    # kept / (kept + refused) estimates the chance that a draft is kept after the one before
    kept: float = 1.0
    refused: float = 1.0
    probe: bool = False  # its estimate was below the cost: after its wait it sends one draft

    def length(self, most: int, cost: float = DRAFT_COST) -> int:
        """How many drafts to send: as many as each has a chance above `cost` of being kept
        with those before it, at most `most` (0: not even one)."""
        p = self.kept / (self.kept + self.refused)
        if p >= 1.0:
            return most
        n = int(math.log(cost) / math.log(p)) if p > 0 else 0
        return max(0, min(most, n))


@dataclass
class SpecCounters:
    """Since start: verifications, tokens drafted, drafts kept (for /metrics)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class Speculation:
    config: SpecConfig
    counters: SpecCounters = field(default_factory=SpecCounters)

    def active(self, num_running: int) -> bool:
        return num_running <= self.config.max_batch

    def draft(self, req: Req, decoding: int = 1) -> tuple[int, ...] | None:
        """The drafts for `req`'s next decode, `decoding` rows running: () when it decodes
        one token as usual, None when it waits for its tokens on their way (its drafts need
        its last one)."""
        sampling = req.sampling
        room = sampling.max_new_tokens - req.num_outputs - req.pending - 1  # +1: not a draft
        # its eos and stop tokens are masked until min_new_tokens (kernels/sampling.py)
        masked = req.num_outputs < sampling.min_new_tokens
        if room < 1 or masked or req.role == "send" or not drafts_allowed(sampling):
            return ()
        rows = req.draft_state
        if rows is None:
            config = self.config
            ngrams = NgramDrafts(config.min_n, config.max_n, config.num_draft_tokens)
            rows = req.draft_state = RowDrafts(ngrams)
        if rows.skip:  # its recent drafts did not pay: it decodes as usual, overlapped
            rows.skip -= 1
            return ()
        length = rows.length(self.config.num_draft_tokens, draft_cost(decoding))
        if length == 0 and not rows.probe:  # not worth one draft: wait, then learn again
            rows.probe = True
            rows.skip = rows.backoff - 1  # this decode is the first it waits
            rows.backoff = min(2 * rows.backoff, MAX_BACKOFF)
            return ()
        if req.pending or req.inflight:
            return None
        rows.probe = False
        rows.ngrams.extend(req.tokens[rows.indexed :])
        rows.indexed = len(req.tokens)
        return tuple(rows.ngrams.propose()[: min(room, max(1, length))])

    def verified(self, req: Req, num_drafts: int, accepted: int) -> None:
        """A verification of `num_drafts` of `req`'s drafts kept `accepted` of them."""
        counters = self.counters
        counters.steps += 1
        counters.drafted += num_drafts
        counters.accepted += accepted
        rows = req.draft_state
        assert rows is not None
        rows.kept = KEEP_MEMORY * rows.kept + accepted
        rows.refused = KEEP_MEMORY * rows.refused + (accepted < num_drafts)
        if accepted:
            rows.backoff = 1
        else:  # nothing kept: wait longer each time before drafting again
            rows.skip = rows.backoff
            rows.backoff = min(2 * rows.backoff, MAX_BACKOFF)
