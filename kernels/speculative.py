"""Verifying drafted tokens (issue 35; the executor's side: actors/executor/draft_asks.py): a
row's target distributions at its k drafted positions and one more, in one forward, decide how
many drafts it keeps and the token after them.

    accepted, tokens = verify_greedy(logits, drafts, lengths)          # exact for greedy
    accepted, tokens = verify_sampled(probs, drafts, lengths, accept_u, draw_u)

    logits / probs  [R, K + 1, V]  row r's target at its last token and at each draft
    drafts          [R, K] int64   row r's drafts in its first lengths[r] places (the rest -1)
    accepted        [R]            how many of its drafts row r keeps (0 .. lengths[r])
    tokens          [R, K + 1]     row r's tokens to emit: its kept drafts, then one more, in
                                   its first accepted[r] + 1 places (the rest -1)

Invariants:
- Greedy: a draft is kept while it equals the target's argmax; the token after is the argmax
  where the first draft failed (or after the last): exactly the tokens decoding one at a time
  would give.
- Sampled (a draft is a point mass q, as a copied n-gram is): draft d at place j is kept with
  probability p_j(d) (`accept_u` [R, K]: u < p_j(d)); at the first one refused, the next token
  is drawn from p_j without d, renormalized (`draw_u` [R], by inverse CDF); all kept, from
  p_k. The emitted tokens are distributed exactly as sampling from the target one at a time
  (the rejection-sampling rule of Leviathan et al. and Chen et al., 2023).
"""

from __future__ import annotations

import torch


def _first_refused(kept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[R]: how many leading places of `kept` [R, K] are true, within each row's length."""
    places = torch.arange(kept.shape[1], device=kept.device)
    kept = kept & (places < lengths.unsqueeze(1))
    return kept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emitted(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[R, K + 1]: each row's kept drafts, then `last`, then -1."""
    rows, width = drafts.shape[0], drafts.shape[1] + 1
    places = torch.arange(width, device=drafts.device).expand(rows, width)
    padded = torch.cat([drafts, drafts.new_full((rows, 1), -1)], dim=1)
    tokens = torch.where(places < accepted.unsqueeze(1), padded, -1)
    return tokens.scatter(1, accepted.unsqueeze(1), last.unsqueeze(1))


def verify_greedy(
    logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return verify_targets(logits.argmax(dim=-1), drafts, lengths)


def verify_targets(
    targets: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_greedy from the argmaxes [R, K + 1] alone."""
    accepted = _first_refused(targets[:, :-1] == drafts, lengths)
    last = targets.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, _emitted(drafts, accepted, last)


def verify_sampled(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    accept_u: torch.Tensor,
    draw_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = drafts.shape
    safe = drafts.clamp(min=0)
    p_draft = probs[:, :k].gather(2, safe.unsqueeze(2)).squeeze(2)  # [R, K]
    accepted = _first_refused(accept_u < p_draft, lengths)
    at = probs.gather(1, accepted.view(rows, 1, 1).expand(rows, 1, probs.shape[2])).squeeze(1)
    refused = accepted < lengths  # the next token comes from the residual, not the bonus place
    banned = safe.gather(1, accepted.clamp(max=k - 1).unsqueeze(1)).squeeze(1) if k else None
    if banned is not None:
        residual = at.scatter(1, banned.unsqueeze(1), 0.0)
        at = torch.where(refused.unsqueeze(1), residual, at)
    cdf = at.cumsum(dim=1)
    target = (draw_u * cdf[:, -1]).unsqueeze(1).contiguous()
    last = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[2] - 1)
    return accepted, _emitted(drafts, accepted, last)
