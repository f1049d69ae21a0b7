"""What 8-bit activations would cost int8's quality: an emulation, not a kernel. Every linear of
the bundled SmolLM2 (its lm_head too) multiplies as a W8A8 kernel with VNNI's `vpdpbusd` or
AMX's int8 tiles would, in float32 arithmetic: activations rounded to 8 bits per row (or per
block along K; symmetric, or with --act-asym unsigned from the row's or block's minimum, as
`vpdpbusd`'s unsigned operand takes them, the minimum's share added from the weights' sums),
weights to int8 per output channel (or per block), optionally both turned by a
block-diagonal Hadamard rotation first (QuaRot's idea: y = (W H^T)(H x) spreads an outlier
channel over its block), then scored against packed float32 as quality.py scores int8.

    python bench/act8_emulation.py                          # per row, no rotation
    python bench/act8_emulation.py --rotate 64 --rotate-down 512 --act-block 64 --weight-block 64
    python bench/act8_emulation.py --act-asym --act-block 32 --weight-block -1  # GGUF's weights

Prints one line:
    act8 rotate=<n> rotate_down=<n> act_block=<n> weight_block=<n> act_asym=<bool>
         only=<shapes|all> chunk=<n> tokens=<n> top1_agreement=<x> ppl_ratio=<x>
         verdict=<pass|fail against int8's bound> machine=<desc>
(block 0: one scale a row / output channel; rotate 0: none; --only 3072x576 960x576 ...: those
linears alone, by their weights' shapes, the others in float32).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import quality
import torch
import torch.nn.functional as F

from shoal.kernels import linear as linear_kinds
from shoal.kernels.linear import LinearKind
from shoal.models import weights as model_weights


def hadamard(n: int) -> torch.Tensor:
    """The n x n orthonormal Hadamard matrix (Sylvester's; n a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rotated(t: torch.Tensor, block: int) -> torch.Tensor:
    """t's last dimension turned block by block (none for 0)."""
    if not block:
        return t
    k = t.shape[-1]
    return (t.reshape(*t.shape[:-1], k // block, block) @ hadamard(block)).reshape(t.shape)


def rounded(t: torch.Tensor, block: int) -> torch.Tensor:
    """t as symmetric 8-bit values give it back: the largest |value| of each row (block 0) or
    block along the last dimension maps to 127."""
    k = t.shape[-1]
    g = t.reshape(*t.shape[:-1], k // block, block) if block else t.unsqueeze(-2)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((g / scale).round().clamp(-127, 127) * scale).reshape(t.shape)


def rounded_unsigned(t: torch.Tensor, block: int) -> torch.Tensor:
    """t as unsigned 8-bit values with a minimum give it back: each row's (block 0) or block's
    smallest value maps to 0, its largest to 255."""
    k = t.shape[-1]
    g = t.reshape(*t.shape[:-1], k // block, block) if block else t.unsqueeze(-2)
    low = g.amin(-1, keepdim=True)
    scale = (g.amax(-1, keepdim=True) - low).clamp_min(1e-12) / 255
    return (((g - low) / scale).round().clamp(0, 255) * scale + low).reshape(t.shape)


@dataclass(frozen=True)
class Scheme:
    rotate: int
    rotate_down: int  # the rotation's block where K is not the hidden size (the MLP's down)
    act_block: int
    weight_block: int  # -1: the weights kept in float32 (the activations' share alone)
    act_asym: bool = False  # activations unsigned from their minimum (rounded_unsigned)
    only: frozenset[str] = frozenset()  # "NxK" shapes emulated (empty: all); the rest float32
    hidden: int = 576  # the model's hidden size (SmolLM2's)

    def rotation(self, k: int) -> int:
        return self.rotate_down if self.rotate_down and k != self.hidden else self.rotate


class Act8Linear:
    """A dense linear that multiplies as `scheme`'s W8A8 kernel would."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme) -> None:
        self.rotate = scheme.rotation(int(weight.shape[1]))
        self.act_block = scheme.act_block
        self.round = rounded_unsigned if scheme.act_asym else rounded
        turned = rotated(weight.float(), self.rotate)
        self.weight = turned if scheme.weight_block < 0 else rounded(turned, scheme.weight_block)
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        x8 = self.round(rotated(x.float(), self.rotate), self.act_block)
        return F.linear(x8, self.weight, self.bias)


def act8_factory(scheme: Scheme) -> Callable[..., object]:
    """make_linear, but a "dense" linear is an Act8Linear."""
    plain = linear_kinds.make_linear

    def make(kind: LinearKind, weight: torch.Tensor, *rest: Any, **named: Any) -> object:
        shape = "x".join(map(str, weight.shape))
        if kind == "dense" and (not scheme.only or shape in scheme.only):
            return Act8Linear(weight, rest[0] if rest else named.get("bias"), scheme)
        return plain(kind, weight, *rest, **named)

    return make


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rotate", type=int, default=0, help="Hadamard block (0: none)")
    parser.add_argument("--rotate-down", type=int, default=0, help="its block for the MLP's down")
    parser.add_argument("--act-block", type=int, default=0, help="0: one scale a row")
    parser.add_argument(
        "--weight-block", type=int, default=0, help="0: one scale a channel; -1: float32"
    )
    parser.add_argument(
        "--act-asym", action="store_true", help="activations unsigned from their minimum"
    )
    parser.add_argument("--only", nargs="+", default=[], help="these NxK linears (e.g. 3072x576)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens a forward (prompt-like)")
    parser.add_argument("--tokens", type=int, default=None, help="the text's first n (all)")
    args = parser.parse_args(argv)
    loaded = quality.load_model(None, progress=False)
    blocks = (args.rotate, args.rotate_down, args.act_block, args.weight_block)
    scheme = Scheme(*blocks, args.act_asym, frozenset(args.only), loaded.config.hidden_size)
    ids = quality.text_ids(loaded, args.tokens)
    window = min(1024, loaded.config.max_position_embeddings)
    dense = model_weights.make_linear
    model_weights.make_linear = act8_factory(scheme)  # type: ignore[assignment]
    try:  # the tested "dense" model's linears are emulated; the packed baseline's pass through
        line = quality.compare(loaded, "dense", "packed", ids, window, args.chunk, torch.float32)
    finally:
        model_weights.make_linear = dense
    top1, ratio = float(line["top1_agreement"]), float(line["ppl_ratio"])  # type: ignore[arg-type]
    passed = top1 >= quality.MIN_AGREEMENT and abs(ratio - 1) <= quality.PPL_TOLERANCE
    fields = {
        **vars(args),
        "only": ",".join(args.only) or "all",
        "tokens": line["tokens"],
        "top1_agreement": top1,
        "ppl_ratio": ratio,
    }
    fields |= {"verdict": "pass" if passed else "fail", "machine": quality.machine()}
    print("act8 " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
