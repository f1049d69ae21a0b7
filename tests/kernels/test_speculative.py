"""kernels/speculative.py: greedy verification keeps exactly what one-at-a-time decoding
would, and sampled verification (rejection sampling against a point-mass draft) emits tokens
distributed as the target: checked by a chi-square test over 40,000 seeded trials, for the
first token and for the second given the first draft was kept."""

from __future__ import annotations

import math

import torch

from shoal.kernels.speculative import verify_greedy, verify_sampled


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10)
    targets = logits.argmax(dim=-1)
    drafts = torch.stack([
        targets[0, :3],                                   # all three kept
        torch.tensor([int(targets[1, 0]), -1, -1]),       # one draft, kept
        torch.tensor([int(targets[2, 0]), (int(targets[2, 1]) + 1) % 10, 5]),  # second refused
    ])  # fmt: skip
    lengths = torch.tensor([3, 1, 3])
    accepted, tokens = verify_greedy(logits, drafts, lengths)
    assert accepted.tolist() == [3, 1, 1]
    assert tokens[0].tolist() == targets[0].tolist()
    assert tokens[1].tolist() == [targets[1, 0], targets[1, 1], -1, -1]
    assert tokens[2].tolist() == [targets[2, 0], targets[2, 1], -1, -1]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The upper tail of Pearson's statistic (Wilson-Hilferty's normal approximation)."""
    n = float(counts.sum())
    keep = probs > 0
    expected = probs[keep] * n
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_verification_preserves_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(35)
    vocab, trials = 8, 40_000
    p0 = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    p1 = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    p2 = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    probs = torch.stack([p0, p1, p2]).expand(trials, 3, vocab).contiguous()
    # drafts from a distribution unlike the target's (an n-gram's guess is no sample of p)
    drafts = torch.stack(
        [
            torch.randint(0, 3, (trials,), generator=gen),
            torch.randint(0, vocab, (trials,), generator=gen),
        ],
        dim=1,
    )
    lengths = torch.full((trials,), 2)
    accepted, tokens = verify_sampled(
        probs,
        drafts,
        lengths,
        torch.rand(trials, 2, generator=gen),
        torch.rand(trials, generator=gen),
    )
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert chi_square_p(first, p0) > 1e-3
    kept = accepted >= 1  # given the first draft was kept, the second token follows p1
    second = torch.bincount(tokens[kept, 1], minlength=vocab).float()
    assert chi_square_p(second, p1) > 1e-3
    assert int(kept.sum()) > 1000 and bool((accepted == 2).any()) and bool((accepted == 0).any())


def test_a_wrong_verifier_fails_the_distribution_test() -> None:
    """The test can fail: keeping every draft emits the drafts' distribution, not p."""
    gen = torch.Generator().manual_seed(36)
    vocab, trials = 8, 40_000
    p0 = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    probs = p0.expand(trials, 2, vocab).contiguous()
    drafts = torch.randint(0, 3, (trials, 1), generator=gen)
    always = torch.zeros(trials, 1)  # u = 0 < p(d): every draft kept
    _, tokens = verify_sampled(probs, drafts, torch.ones(trials, dtype=torch.int64), always,
                               torch.rand(trials, generator=gen))  # fmt: skip
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert chi_square_p(first, p0) < 1e-6
