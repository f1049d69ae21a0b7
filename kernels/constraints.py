"""Row constraints: what a request asks of its row's logits beyond SamplingParams' filters.

A constraint is built once per row, when the row starts (the executor's RowInit, again after a
retraction), from the request's SamplingParams; `sample` (kernels/sampling.py) lets each of a
row's constraints edit that row's logits before the stop-token mask and the filters, and the
executor tells it every token the row sampled, in order (`advance`).

    constraints = row_constraints(params, RowContext(device, grammars))  # () if none asked
    SamplingRow(..., constraints=constraints)        # sample() calls mask_ on the row's logits
    error = constraint.advance(token_id)             # each token the row sampled, in order

Invariants:
- A row without constraints pays nothing: `sample` takes its all-greedy fast path, and the
  hook is one loop over the rows that have any.
- `mask_` edits one row's float32 logits [V] in place and never reads another row's.
- A constraint that `waits_for_tokens` reads state that `advance` moved; a launch that samples
  such a row first waits until all its earlier tokens have arrived, as rows with penalties
  do (on one stage after its forward is launched: the step's sampling, not its forward,
  waits), so `mask_` always sees every earlier token advanced.
- `advance` runs on the executor's completion thread, `mask_` on its launch thread (or the
  last pipeline stage's); the executor's `arrived` condition orders the two.
- `advance` answers a message when the row cannot go on (a grammar that refused the token):
  that row alone ends with the error (StepResult.row_errors); raising fails the whole step.

A new kind is one builder in ROW_CONSTRAINTS (docs/architecture.md, "A per-request option").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.kernels.grammar_row import GrammarRow
from shoal.kernels.grammars import Grammars
from shoal.kernels.logit_bias import LogitBias
from shoal.params import SamplingParams


class RowConstraint(Protocol):
    @property
    def waits_for_tokens(self) -> bool:
        """True when mask_ depends on the row's earlier tokens (a grammar's state)."""
        ...

    def mask_(self, logits: torch.Tensor) -> None:
        """Edit one row's float32 logits [V] in place (a ban is -inf)."""
        ...

    def advance(self, token_id: int) -> str | None:
        """The row sampled token_id: the next one after every token advanced before. A
        message when the row cannot go on (said once; later calls answer None)."""
        ...


@dataclass(frozen=True)
class RowContext:
    """What a builder may need beside the params: the device the row's logits are on, and
    the engine's grammars (kernels/grammars.py; None where no request can carry one)."""

    device: torch.device
    grammars: Grammars | None = None


ConstraintBuilder = Callable[[SamplingParams, RowContext], RowConstraint | None]

# Each kind's builder: the constraint a request's params ask for, or None. The grammar runs
# last: a token logit_bias bans stays banned, and the grammar's bans are never lifted.
ROW_CONSTRAINTS: tuple[ConstraintBuilder, ...] = (LogitBias.build, GrammarRow.build)


def row_constraints(params: SamplingParams, context: RowContext) -> tuple[RowConstraint, ...]:
    """The constraints `params` ask of a row, in ROW_CONSTRAINTS' order (the order their
    mask_ runs in)."""
    built = (build(params, context) for build in ROW_CONSTRAINTS)
    return tuple(c for c in built if c is not None)


def advance_all(constraints: tuple[RowConstraint, ...], token_ids: list[int]) -> None:
    """Tell each constraint the tokens a row sampled, in order (a retracted row's replay:
    tokens each constraint took before, so none has anything to say)."""
    for token_id in token_ids:
        for constraint in constraints:
            constraint.advance(token_id)
