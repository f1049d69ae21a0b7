"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE, as transformers 5.23 computes it, run
as a grouped matmul: each expert that some token picked runs once, over all those tokens.

    router    [E, H]       logits = x @ router.T
    gate_up   [E, 2I, H]   rows [0, I) the gate projection, rows [I, 2I) the up projection
    down      [E, H, I]
    out[t] = sum over t's top_k experts e of  w[t, e] * down[e] @ (silu(gate[e] x[t]) * up[e] x[t])

Routing (transformers' TopKRouter of each family): softmax of the logits in float32, top-k,
renormalised to sum 1 when `normalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
Qwen3-MoE then casts the k weights to the model dtype and weights the expert outputs in it;
Mixtral keeps them float32, so the weighted outputs are float32 (`float32_weights=True`).

One step (S = T * top_k (token, expert) pairs, pair p = t * top_k + j):

    sort the pairs by expert (stable)  ->  x_sorted [S, H] = x[token of each pair]
    for each expert hit (one Python loop; T=1 runs only top_k experts):
        out_sorted[its rows] = down[e] @ silu_mul(gate_up[e] @ x_sorted[its rows])
    acc [T, H] float32 .index_add_(0, token of each pair, out_sorted * weight of each pair)
    return acc in x's dtype

Against transformers, which on CPU defaults to `experts_implementation="grouped_mm"` (a full
model; a lone block falls back to the eager loop over experts):
  * grouped_mm sums each token's k weighted outputs in top-k order (largest weight first) in
    float32 and casts once; the float32 accumulator here adds them in increasing expert id.
    With k = 2 the two orders give the same bits; with k > 2 they may differ in the last
    bits of float32 (seldom visible after a cast to bfloat16).
  * the eager loop adds in increasing expert id, as here, but into a tensor of the model
    dtype, rounding after every add in bfloat16.
  * either way, CPU matmuls may differ in the last bits for the same row in a block of
    another height or at another position, so float32 results agree to a few ulps, not bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Experts:
    """One MoE layer's router and experts. Holds the tensors it is given (the caller hands over
    owned copies); `load` copies a weight update into them, so it never keeps the caller's."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        normalize: bool,
        *,
        float32_weights: bool = False,
    ) -> None:
        """`float32_weights`: weight the expert outputs with the float32 routing weights
        (Mixtral) rather than with the weights cast to the model dtype (Qwen3-MoE). The two
        agree in float32 models."""
        num_experts, hidden_size = router.shape
        intermediate_size = down.shape[2]
        assert gate_up.shape == (num_experts, 2 * intermediate_size, hidden_size), gate_up.shape
        assert down.shape == (num_experts, hidden_size, intermediate_size), down.shape
        assert router.dtype == gate_up.dtype == down.dtype, (router.dtype, gate_up.dtype)
        assert 1 <= top_k <= num_experts, (top_k, num_experts)
        self.router = router.contiguous()
        self.gate_up = gate_up.contiguous()
        self.down = down.contiguous()
        self.top_k = top_k
        self.normalize = normalize
        self.float32_weights = float32_weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] in the weights' dtype -> [T, H]."""
        top_weights, top_experts = self.route(x)
        return self.mix(x, top_weights, top_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, top_k] routing weights, [T, top_k] expert ids), the experts by falling
        probability. The weights are float32 when `float32_weights`, else x's dtype."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top_weights /= top_weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            top_weights = top_weights.to(x.dtype)
        return top_weights, top_experts

    def mix(
        self, x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's experts, grouped by expert (module docstring)."""
        num_tokens, hidden_size = x.shape
        sorted_experts, pair_order = torch.sort(top_experts.reshape(-1), stable=True)
        token_of_pair = pair_order // self.top_k
        x_sorted = x[token_of_pair]
        out_sorted = torch.empty_like(x_sorted)
        hit_experts, pairs_per_expert = torch.unique_consecutive(sorted_experts, return_counts=True)
        start = 0
        for expert, count in zip(hit_experts.tolist(), pairs_per_expert.tolist(), strict=True):
            end = start + count
            gate, up = F.linear(x_sorted[start:end], self.gate_up[expert]).chunk(2, dim=-1)
            torch.mm(F.silu(gate) * up, self.down[expert].t(), out=out_sorted[start:end])
            start = end
        weighted = out_sorted * top_weights.reshape(-1)[pair_order].unsqueeze(-1)
        acc = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=x.device)
        acc.index_add_(0, token_of_pair, weighted.float())
        return acc.to(x.dtype)

    def load(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """A weight update: copy into the held tensors (same shapes; cast to their dtype)."""
        for held, new in zip(self.tensors(), (router, gate_up, down), strict=True):
            assert new.shape == held.shape, (new.shape, held.shape)
            held.copy_(new)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds, in a fixed order: [router, gate_up, down]."""
        return [self.router, self.gate_up, self.down]
