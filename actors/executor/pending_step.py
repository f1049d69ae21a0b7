"""A launched step's results on their way to the host, and the per-row sampling state they
complete.

Only a tracked row (actors/executor/sampling_slots.py: penalties, row constraints, a
min_new_tokens mask still pending; with pipeline stages every row) keeps the two counts below;
a plain row's step lives on the device (`SamplingSlots`) and its tokens only go to the
scheduler, so a step of plain rows costs the host no per-row work here.

- `RowState.num_sampled` counts tokens launched for sampling; only the launch thread writes it.
  It is the row's seed-stream step, known without waiting for the device. A speculating row
  (tracked only over pipeline stages) moves it on by 1 + k, its draws; it never waits for its
  tokens (no penalty, no constraint: actors/scheduler/speculation.py), so that count is never
  held against them.
- `RowState.output_ids` are the sampled tokens that reached the host; only the completion
  thread appends (`PendingStep.result`). Penalties need them all, so a launch that samples a
  row with penalties first waits until that row's earlier tokens have arrived (such rows give
  up overlap), and so does a row with a row constraint that waits for its tokens
  (kernels/constraints.py). The completion thread advances a row's constraints on each token
  it appends, under `arrived`, before it wakes a launch waiting for them. A row that waits is
  tracked for life, so every token it waits for is appended.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.actors.executor.draft_asks import DraftAsks
from shoal.actors.executor.prompt_asks import PromptAsks
from shoal.actors.executor.routed_asks import RoutedAsks
from shoal.actors.executor.streams import HostResult
from shoal.actors.messages import ExpertRows
from shoal.kernels.constraints import RowConstraint
from shoal.kernels.sampling import SamplingRow, has_penalty
from shoal.params import SamplingParams
from shoal.results import TokenLogprob


class StepResult(NamedTuple):
    """One step's results on the host, one per sampling sequence in batch order."""

    next_tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]  # empty when no row asked for logprobs
    # one per prompt chunk that asked for prompt logprobs, in batch order (prompt_asks.py)
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # (place in batch order, rows) per sequence that recorded its routed experts
    routed_experts: tuple[tuple[int, ExpertRows], ...] = ()
    # (place in batch order, why) per row whose constraint cannot go on: it ends alone
    row_errors: tuple[tuple[int, str], ...] = ()
    # (place, kept drafts) per speculating decode that kept any (StepDone.drafted)
    drafted: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclass
class RowState:
    sampling: SamplingParams
    seed: int
    prompt_ids: tuple[int, ...]
    output_ids: list[int]
    num_sampled: int
    constraints: tuple[RowConstraint, ...] = ()  # advanced through output_ids
    lost: bool = False  # a step that sampled this row failed: its tokens never arrive
    # A launch that samples this row first waits until it has caught up (fixed for its life).
    waits_for_tokens: bool = field(init=False)

    def __post_init__(self) -> None:
        waits = any(c.waits_for_tokens for c in self.constraints)
        self.waits_for_tokens = has_penalty(self.sampling) or waits

    def caught_up(self) -> bool:
        return self.lost or len(self.output_ids) == self.num_sampled


class PendingStep:
    """A launched step whose sampled tokens (and logprobs) are on their way to the host (with
    pipeline stages: whose last stage will start them there, `host` a Future).

    `states` are the step's tracked rows, states[i] at place at[i] of the batch (default i);
    `logprob_rows` the (place, top_logprobs, number of token_ids_logprob) of each row that
    asked for logprobs, in order; `prompt` the step's asked prompt positions, if any;
    `routed` its positions recording their routed experts, if any. The host tensors are the
    tokens, then the logprob rows' five columns (logprob_gather.py) if any, then the prompt
    positions' five, then the routed experts' ids, then the speculating rows' emitted tokens
    (`drafts`, draft_asks.py)."""

    def __init__(
        self,
        states: list[RowState],
        host: HostResult | Future[HostResult],
        logprob_rows: list[tuple[int, int, int]],
        arrived: threading.Condition,
        at: list[int] | None = None,
        prompt: PromptAsks | None = None,
        routed: RoutedAsks | None = None,
        drafts: DraftAsks | None = None,
    ) -> None:
        self.states = states
        self.at = list(range(len(states))) if at is None else at
        self.host = host
        self.logprob_rows = logprob_rows
        self.arrived = arrived
        self.prompt = prompt
        self.routed = routed
        self.drafts = drafts

    def result(self) -> StepResult:
        try:
            host = self.host.result() if isinstance(self.host, Future) else self.host
            tensors = host.wait()
            tokens: tuple[int, ...] = tuple(tensors[0].tolist())
        except BaseException:
            self._lose()  # nobody may wait for these tokens any longer
            raise
        rest = tensors[1:]
        drafted: tuple[tuple[int, tuple[int, ...]], ...] = ()
        if self.drafts is not None:
            drafted = self.drafts.unpack(rest[-1])
            rest = rest[:-1]
        row_errors = self._arrive(tokens, dict(drafted)) if self.states else ()
        routed: tuple[tuple[int, ExpertRows], ...] = ()
        if self.routed is not None:
            routed = self.routed.unpack(rest[-1])
            rest = rest[:-1]
        prompt: tuple[tuple[TokenLogprob, ...], ...] = ()
        if self.prompt is not None:
            prompt = self.prompt.unpack(rest[-5:])
            rest = rest[:-5]
        if not self.logprob_rows:
            return StepResult(tokens, (), prompt, routed, row_errors, drafted)
        chosen, rank, values, ids, listed = (t.tolist() for t in rest)
        out: list[TokenLogprob | None] = [None] * len(tokens)
        for j, (i, k, n) in enumerate(self.logprob_rows):
            top = tuple(zip(ids[j][:k], values[j][:k], strict=True))
            out[i] = TokenLogprob(tokens[i], float(chosen[j]), top, tuple(listed[j][:n]), rank[j])
        return StepResult(tokens, tuple(out), prompt, routed, row_errors, drafted)

    def _arrive(
        self, tokens: tuple[int, ...], drafted: dict[int, tuple[int, ...]]
    ) -> tuple[tuple[int, str], ...]:
        """The tracked rows' tokens (a speculating row's kept drafts before its token):
        appended, their constraints advanced, waiters woken. Returns (place, why) for each
        row a constraint cannot take further."""
        errors: list[tuple[int, str]] = []
        with self.arrived:
            try:
                for state, i in zip(self.states, self.at, strict=True):
                    token = tokens[i]
                    state.output_ids.extend(drafted.get(i, ()))
                    state.output_ids.append(token)
                    for constraint in state.constraints:
                        error = constraint.advance(token)
                        if error is not None:
                            errors.append((i, error))
            except BaseException:  # a constraint failed: the step fails, as its launch would
                for state in self.states:
                    state.lost = True
                raise
            finally:
                self.arrived.notify_all()
        return tuple(errors)

    def _lose(self) -> None:
        with self.arrived:
            for state in self.states:
                state.lost = True
            self.arrived.notify_all()


def sampling_rows(states: list[RowState], arrived: threading.Condition) -> list[SamplingRow]:
    """Each row's sampling view, on the launch thread; a row that waits for its tokens (with
    penalties, or a constraint that waits) first waits for its earlier tokens to arrive."""
    rows = []
    for s in states:
        outputs: tuple[int, ...] | list[int] = s.output_ids
        if s.waits_for_tokens:
            with arrived:
                arrived.wait_for(s.caught_up)
                if s.lost:
                    raise RuntimeError("an earlier step of this request failed")
                outputs = tuple(s.output_ids)
        row = SamplingRow(s.sampling, s.seed, s.prompt_ids, outputs, s.num_sampled, s.constraints)
        rows.append(row)
    return rows
