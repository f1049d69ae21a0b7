"""Which decodes speculate, and with what drafts (issue 35): plain Python, no asyncio, no torch.

A speculating decode launches its row's last token and k drafted ones as one chunk of 1 + k
positions; the executor keeps the longest prefix of drafts its target agrees with and one more
token (actors/executor/draft_asks.py), so a step emits 1 .. k + 1 tokens for the row.

    spec = Speculation(SpecConfig(...))
    spec.active(num_running)         # this step may speculate: few enough rows decode
    draft = spec.draft(req, num_running)  # its next decode's drafts; (): none; None: wait
    spec.verified(req, k, accepted)  # its result: the row's estimates, the counters

Switched by load: a step speculates only while at most `max_batch` requests run (a bigger
batch already reads each weight once for many rows) and no prompt waits or is prefilled (the
planner's `_speculates`); a row speculates only when its sampling edits nothing a draft would
need per position (`drafts_allowed`). Per row, what its drafts
paid decides, apart for each length of the n-gram match they come from (`MATCH_BOUNDS`: 1, 2,
3, 4-7, 8+ tokens agreeing, `NgramDrafts.match`), since the match's length foretells
acceptance: it sends as many drafts as each has a chance above a draft's cost of being kept
with those before it (`RowDrafts.length`; the cost is DRAFT_COST alone and more with more
rows decoding: `draft_cost`). Each length starts from a prior (`PRIOR_KEPT`: a match of one
token is not worth a draft, one of 8+ is worth 8) and learns from the row's verifications;
once a class's estimate fell below even one draft's cost, the row waits 1, 2, 4 ..
`MAX_BACKOFF` decodes of that class before it sends one draft of it to learn again (a class
whose prior is below the cost never drafts), so a row that copies again is caught. Drafts
need the row's last token: a row with tokens on their way waits for them (no overlap: `draft`
answers None) when the match they can make is worth drafts, one token longer than its known
tokens' at most (a longer n-gram ending in the new token needs the shorter before it); any
other decodes overlapped as usual, and so does a row's first decode, its prompt's token on its
way: a burst's first request would otherwise stall the launches while the rest of the burst
comes in (at 16 streams the burst's first tokens came ~25 ms later). At one stream that costs
a copying request 0-0.45 of its 39-58 steps (bench/spec_replay.py on the bench's answers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.actors.scheduler.ngram_drafts import NgramDrafts
from shoal.actors.scheduler.request import Req
from shoal.params import SamplingParams

# What one draft position adds to a decode's step, as a share of it (a CPU step of SmolLM2
# verifying 4 drafts: 1.26x a decode in float32, 1.66x in int8): a draft is worth sending
# while the chance that it and those before it are kept is above this.
DRAFT_COST = 0.15
KEEP_MEMORY = 0.8  # how much of a row's earlier verifications its estimate keeps
# A match's length class: the first bound it is at most, else the last class (8+ tokens).
MATCH_BOUNDS = (1, 2, 3, 7)
# Each class's prior, as drafts kept against one refusal (a chance of kept / (kept + 1) that a
# draft is kept after the one before): 0.09, 0.5, 0.67, 0.8, 0.89. Fitted loosely to SmolLM2's
# greedy answers to bench/speculative.py's prompts (the first draft kept after 14-18% of the
# 1-token matches, 31-43% of 2, 53-82% of 3, 76-100% of 4-7, 76-98% of 8+; bench/README.md):
# on those answers replayed through this policy (bench/spec_replay.py), against the single
# estimate and backoff before it, the copy prompts' cost fell 6-20%, the prose ones' up to
# 13% (one rose 0.6%).
PRIOR_KEPT = (0.1, 1.0, 2.0, 4.0, 8.0)
MAX_BACKOFF = 16


def match_class(length: int) -> int:
    for i, bound in enumerate(MATCH_BOUNDS):
        if length <= bound:
            return i
    return len(MATCH_BOUNDS)


def draft_cost(decoding: int) -> float:
    """What a draft position costs as a share of a token's time, `decoding` rows running: a
    step of M rows costs about 1 + DRAFT_COST (M - 1) one-row steps and makes M tokens, so a
    draft, DRAFT_COST of a one-row step, is DRAFT_COST M / (1 + DRAFT_COST (M - 1)) of a
    token's time: DRAFT_COST at one row, 0.41 at 4, 0.59 at 8."""
    rows = max(1, decoding)
    return DRAFT_COST * rows / (1.0 + DRAFT_COST * (rows - 1))


@dataclass(frozen=True)
class SpecConfig:
    # Drafts verified per row and step at most. 12: SmolLM2's greedy answers to
    # bench/speculative.py's prompts replayed through this policy (bench/spec_replay.py
    # --num-draft-tokens 8 12 16) took 6-8% fewer steps on the copy prompts than with 8 (a
    # draft costing 0.065 of a step, float32's, or 0.14, int8's), 16 at most 3% fewer again;
    # the prose ones 0.2-0.4% more.
    num_draft_tokens: int = 12
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
    """One request's n-gram index over its tokens so far and, per match class, its decayed
    counts of drafts kept and of verifications that refused one: kept / (kept + refused)
    estimates the chance that a draft is kept after the one before."""

    ngrams: NgramDrafts
    indexed: int = 0  # tokens of the request given to `ngrams`
    kept: list[float] = field(default_factory=lambda: list(PRIOR_KEPT))
    refused: list[float] = field(default_factory=lambda: [1.0] * len(PRIOR_KEPT))
    sent_class: int = 0  # the match class of the drafts in flight
    # per class, once not worth a draft: decodes left before it sends one to learn again, and
    # the next such wait
    wait: list[int] = field(default_factory=lambda: [0] * len(PRIOR_KEPT))
    backoff: list[int] = field(default_factory=lambda: [1] * len(PRIOR_KEPT))
    owed: bool = False  # a probe decided while its tokens were on their way

    def length(self, cls: int, most: int, cost: float = DRAFT_COST) -> int:
        """How many drafts of a class-`cls` match to send: as many as each has a chance above
        `cost` of being kept with those before it, at most `most` (0: not even one)."""
        kept, refused = self.kept[cls], self.refused[cls]
        p = kept / (kept + refused)
        if p >= 1.0:
            return most
        n = int(math.log(cost) / math.log(p)) if p > 0 else 0
        return max(0, min(most, n))

    def probe(self, cls: int, cost: float) -> bool:
        """Whether a decode of a class not worth one draft sends one anyway, to learn again:
        after 1, 2, 4 .. MAX_BACKOFF such decodes; never for a class whose prior is below."""
        prior = PRIOR_KEPT[cls]
        if prior / (prior + 1.0) <= cost:
            return False
        if self.wait[cls]:
            self.wait[cls] -= 1
            return False
        self.wait[cls] = self.backoff[cls]
        self.backoff[cls] = min(2 * self.backoff[cls], MAX_BACKOFF)
        return True


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
        if not req.num_outputs and req.pending:
            return ()  # its prompt's token on its way: decode overlapped (the docstring above)
        rows = req.draft_state
        if rows is None:
            config = self.config
            ngrams = NgramDrafts(config.min_n, config.max_n, config.num_draft_tokens)
            rows = req.draft_state = RowDrafts(ngrams)
        rows.ngrams.extend(req.tokens[rows.indexed :])
        rows.indexed = len(req.tokens)
        agree, drafts = rows.ngrams.match()
        waits = bool(req.pending or req.inflight)
        if waits:  # its tokens known so far: the one on its way makes a match one longer at most
            agree += 1
        elif not drafts:
            rows.owed = False
            return ()
        cls = match_class(agree)
        cost = draft_cost(decoding)
        length = rows.length(cls, self.config.num_draft_tokens, cost)
        if length == 0 and not rows.owed and not rows.probe(cls, cost):
            return ()  # not worth one draft: decode as usual
        if waits:
            rows.owed = length == 0  # a probe: sent once its tokens are in
            return None
        rows.owed = False
        rows.sent_class = cls
        return tuple(drafts[: min(room, max(1, length))])

    def verified(self, req: Req, num_drafts: int, accepted: int) -> None:
        """A verification of `num_drafts` of `req`'s drafts kept `accepted` of them."""
        counters = self.counters
        counters.steps += 1
        counters.drafted += num_drafts
        counters.accepted += accepted
        rows = req.draft_state
        assert rows is not None
        cls = rows.sent_class
        rows.kept[cls] = KEEP_MEMORY * rows.kept[cls] + accepted
        rows.refused[cls] = KEEP_MEMORY * rows.refused[cls] + (accepted < num_drafts)
        if accepted:
            rows.backoff[cls] = 1
