"""Issue 32's targets read from a CPU sitting's lines (bench/cpu_targets.py runs the steps):
each target's figure for shoal and its peer, the bound it is held to, and whether it holds.

    targets(records) -> [Target(name, shoal, peer, peer_value, bound, met, ...)]
    verdict(target)  -> "met" | "missed" | "not run" | "not this CPU's"
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

Record = dict[str, str]


@dataclass(frozen=True)
class Target:
    name: str
    shoal: float | None
    peer: str
    peer_value: float | None
    bound: str
    met: bool | None  # None: not run
    comparable: bool = True  # shoal / peer means something (not for quality's two figures)
    applies: bool = True  # the target holds on this CPU (int8's 2x: only with VNNI or AMX)

    @property
    def ratio(self) -> float | None:
        if self.shoal is None or not self.peer_value or not self.comparable:
            return None
        return self.shoal / self.peer_value


def _pick(records: list[Record], step: str, key: str, **match: str) -> float | None:
    """`key` of the step's first line whose fields are `match`."""
    for r in records:
        if r["step"] == step and key in r and all(r.get(k) == v for k, v in match.items()):
            return float(r[key])
    return None


def _ratio_target(
    name: str, shoal: float | None, peer: str, value: float | None, least: float
) -> Target:
    met = None if shoal is None or not value else shoal / value >= least
    return Target(name, shoal, peer, value, f"ratio >= {least}", met)


def _no_higher(name: str, shoal: float | None, peer: str, value: float | None) -> Target:
    met = None if shoal is None or value is None else shoal <= value
    return Target(name, shoal, peer, value, "shoal <= peer", met)


def _serving(
    records: list[Record], step: str, system: str, peer: str, what: str, c: str
) -> tuple[float | None, float | None]:
    """`what` at concurrency c for shoal (`system`) and its peer in a serving step."""
    at = {"load": c, "mode": "concurrency"}
    shoal = _pick(records, step, what, system=system, **at)
    return shoal, _pick(records, step, what, system=peer, **at)


def _offline(records: list[Record]) -> list[Target]:
    out = []
    for step, label in (("offline_default", "default"), ("offline_float32", "float32")):
        shoal = _pick(records, step, "tok_per_s", system="shoal")
        vllm = _pick(records, step, "tok_per_s", system="vllm")
        out.append(_ratio_target(f"offline {label}, tok/s", shoal, "vLLM", vllm, 1.3))
    int8 = _pick(records, "offline_int8", "tok_per_s", system="shoal")
    floats = [
        f
        for s in ("offline_float32", "offline_float32_after")
        if (f := _pick(records, s, "tok_per_s", system="shoal")) is not None
    ]
    f32 = statistics.fmean(floats) if floats else None
    target = _ratio_target("offline int8 (VNNI/AMX CPU), tok/s", int8, "shoal float32", f32, 2.0)
    out.append(dataclasses.replace(target, applies=_integer_units(records)))
    return out


def _integer_units(records: list[Record]) -> bool:
    """Whether the CPU the int8 run named (its `machine`: model, then ISA features) has the
    integer dot products int8's 2x is asked of: VNNI (`vpdpbusd`) or AMX's int8 tiles. An
    AVX2-only CPU (a Zen 3 EPYC) has neither. No int8 line: held to it."""
    named = (r.get("machine", "") for r in records if r["step"] == "offline_int8")
    desc = next(named, None)
    return desc is None or "vnni" in desc or "amx_int8" in desc


def _served(records: list[Record]) -> list[Target]:
    out = []
    peers = (r.get("system", "") for r in records if r["step"] == "serving_default")
    peer = next((p for p in peers if p.startswith("vllm")), "vllm")  # vllm-bfloat16 or vllm
    shoal, vllm = _serving(records, "serving_default", "shoal", peer, "out_tok_per_s", "16")
    out.append(_ratio_target("serving default 16 streams, tok/s", shoal, "vLLM", vllm, 1.3))
    for what, label in (("ttft_ms_median", "TTFT"), ("itl_ms_median", "ITL")):
        s, v = _serving(records, "serving_default", "shoal", peer, what, "16")
        out.append(_no_higher(f"serving default 16 streams, {label} median ms", s, "vLLM", v))
    f32 = "shoal_--dtype_float32"
    shoal, vllm = _serving(records, "serving_float32", f32, "vllm", "out_tok_per_s", "16")
    out.append(_ratio_target("serving float32 16 streams, tok/s", shoal, "vLLM", vllm, 1.3))
    one, peer_one = _serving(records, "serving_float32", f32, "vllm", "itl_ms_median", "1")
    met = None if one is None else one <= 15
    name = "one stream float32, ITL median ms"
    out.append(Target(name, one, "vLLM", peer_one, "shoal <= 15 ms", met))
    s, v = _serving(records, "one_stream_int8", "shoal-int8", "llamacpp", "itl_ms_median", "1")
    out.append(_no_higher("one stream int8, ITL median ms", s, "llama.cpp Q4_1", v))
    return out


def _quality(records: list[Record]) -> list[Target]:
    out = []
    for kind, least, most in (("bf16", 0.99, 0.01), ("int8", 0.97, 0.03)):
        top1 = _pick(records, f"quality_{kind}", "top1_agreement", kind="quality")
        ppl = _pick(records, f"quality_{kind}", "ppl_ratio", kind="quality")
        met = None if top1 is None or ppl is None else top1 >= least and abs(ppl - 1) <= most
        bound = f"top-1 >= {least}, ppl within {most:.0%}"
        name = f"quality {kind}, top-1 against float32"
        out.append(Target(name, top1, "its ppl ratio", ppl, bound, met, comparable=False))
    return out


def targets(records: list[Record]) -> list[Target]:
    """Issue 32's targets from the steps' lines (a step not run leaves its targets `not run`)."""
    return _offline(records) + _served(records) + _quality(records)


def verdict(t: Target) -> str:
    if t.met is None:
        return "not run"
    if not t.applies:
        return "not this CPU's"
    return "met" if t.met else "missed"
