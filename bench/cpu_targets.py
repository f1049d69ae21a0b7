"""Issue 32's CPU targets in one sitting, each beside its peer from the same run, on the CPU at
hand: the benchmarks run one after another and their lines become one table (bench/README.md's
"Every server CPU" wants it from every CPU a session lands on).

    python bench/cpu_targets.py --vllm-python V --llamacpp-python L --raw bench/cpu_targets.jsonl
    python bench/cpu_targets.py ... --rounds 2                    # all of it twice (noisy hosts)
    python bench/cpu_targets.py --from bench/cpu_targets.jsonl    # the table again, nothing run
    python bench/cpu_targets.py --dry-run                         # the commands, nothing run

The steps (~8 minutes a round on the 2-core Zen 5 EPYC with both peers):
    offline_default        offline.py --peers vllm: shoal's default dtype against vLLM's
    offline_float32        the same with --dtype float32 on both
    offline_int8           offline.py --quantization int8, shoal alone
    offline_float32_after  --dtype float32, shoal alone (int8: against both float32 runs' mean)
    serving_default        serving.py --launch shoal vllm, c = 1 16, vLLM in its default dtype
                           (bfloat16 where the CPU has bfloat16 dot products)
    serving_float32        the same, both in float32
    one_stream_int8        serving.py --launch shoal llamacpp --quantization int8, c = 1
    quality_bf16, quality_int8   quality.py --linear bf16 / int8 (teacher-forced, bundled text)

A step that fails is reported and the next one runs; --settle seconds pass between two steps
(a stopped server's processes leave the CPU). One line per target and round:
    cpu_target round=<n> target=<name> shoal=<x> peer=<name> peer_value=<y> ratio=<x/y>
               bound=<what meets it> verdict=<met|missed|not_run|not_this_CPU's> machine=<desc>
(int8's 2x is asked only of a CPU with VNNI or AMX: on an AVX2 one its verdict is
not_this_CPU's, its figures still shown).
then the CPU, each system's setup (shoal's kernels) and a Markdown table, a row a target and a
column a round ("shoal / peer (ratio): verdict").
--raw appends every step's lines (as JSON, with its step's name and round) so that --from can
rebuild them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_format import emit, machine

from shoal.kernels.cpu_features import bf16_by_default, read_cpu_features

BENCH = Path(__file__).resolve().parent
KINDS = ("offline", "serving", "quality")  # the lines a step's output is read for
Record = dict[str, str]


@dataclass(frozen=True)
class Step:
    name: str
    script: str
    args: tuple[str, ...]


def steps(vllm: str | None, llamacpp: str | None, vllm_dtype: str) -> list[Step]:
    v = f"--vllm-python {shlex.quote(vllm)}" if vllm else ""
    lc = f"--llamacpp-python {shlex.quote(llamacpp)}" if llamacpp else ""
    off = "--hf-batch 0 --hf-solo 0"
    serve = "--concurrency 1 16 --no-progress"
    plan = {
        "offline_default": f"offline.py --peers vllm {v} {off}",
        "offline_float32": f"offline.py --peers vllm {v} {off} --dtype float32",
        "offline_int8": f"offline.py --peers {off} --quantization int8",
        "offline_float32_after": f"offline.py --peers {off} --dtype float32",
        "serving_default": f"serving.py --launch shoal vllm {v} --vllm-dtype {vllm_dtype} {serve}",
        "serving_float32": f"serving.py --launch shoal vllm {v} --vllm-dtype float32 "
        f"--shoal-args '--dtype float32' {serve}",
        "one_stream_int8": f"serving.py --launch shoal llamacpp {lc} --quantization int8 "
        "--concurrency 1 --no-progress",
        "quality_bf16": "quality.py --linear bf16",
        "quality_int8": "quality.py --linear int8",
    }
    return [Step(name, (w := shlex.split(cmd))[0], tuple(w[1:])) for name, cmd in plan.items()]


def run_step(step: Step) -> list[Record]:
    """The step's `offline`/`serving`/`quality` lines, its output echoed to stderr as it comes."""
    cmd = [sys.executable, str(BENCH / step.script), *step.args]
    began = time.monotonic()
    print(f"cpu_targets step={step.name}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=BENCH.parent)
    assert proc.stdout is not None
    records = []
    for line in proc.stdout:
        sys.stderr.write(line)
        words = line.split()
        if words and words[0] in KINDS:
            fields = dict(f.split("=", 1) for f in words[1:] if "=" in f)
            records.append({"step": step.name, "kind": words[0], **fields})
    rc = proc.wait()
    took = time.monotonic() - began
    print(f"cpu_targets step={step.name} rc={rc} seconds={took:.0f}", file=sys.stderr, flush=True)
    return records


def run_plan(plan: list[Step], rounds: int, settle: float, raw: Path | None) -> list[Record]:
    """Every step of the plan `rounds` times, `settle` seconds between two; lines kept in `raw`."""
    records = []
    for n in range(rounds):
        for i, step in enumerate(plan):
            if n or i:
                time.sleep(settle)
            got = [{**r, "round": str(n + 1)} for r in run_step(step)]
            records += got
            if raw is not None:
                with raw.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in got)
    return records


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


def _show(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def verdict(t: Target) -> str:
    if t.met is None:
        return "not run"
    if not t.applies:
        return "not this CPU's"
    return "met" if t.met else "missed"


def _cell(t: Target) -> str:
    ratio = "" if t.ratio is None else f" ({t.ratio:.2f}x)"
    return f"{_show(t.shoal)} / {_show(t.peer_value)}{ratio}: {verdict(t)}"


def setups(records: list[Record]) -> list[str]:
    """Each system's setup as its offline lines name it (shoal's kernels, vLLM's dtype), once."""
    named = (f"{r['step']} {r['system']}: {r['setup']}" for r in records if "setup" in r)
    return list(dict.fromkeys(named))


def table(rounds: list[list[Target]], desc: str, kernels: list[str]) -> str:
    """One row a target, one column a round: shoal / peer (ratio): verdict."""
    cols = [f"round {i + 1}: shoal / peer" for i in range(len(rounds))]
    lines = [f"CPU: {desc}", *(f"- {k}" for k in kernels), ""]
    lines.append("| target | peer | bound | " + " | ".join(cols) + " |")
    lines.append("| --- " * (3 + len(cols)) + "|")
    for row in zip(*rounds, strict=True):
        first = row[0]
        lines.append(
            f"| {first.name} | {first.peer} | {first.bound} | " + " | ".join(map(_cell, row)) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument(
        "--vllm-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="vLLM's default dtype here (default: bfloat16 where shoal's is)",
    )
    parser.add_argument("--steps", nargs="+", default=None, help="only these (in the order above)")
    parser.add_argument("--raw", type=Path, default=None, help="append the steps' lines here")
    parser.add_argument(
        "--from", dest="source", type=Path, default=None, help="a --raw file: the table only"
    )
    parser.add_argument("--rounds", type=int, default=1, help="the whole plan this many times")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds between steps (a server's exit)"
    )
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="append the targets as JSON")
    args = parser.parse_args(argv)
    vllm_dtype = args.vllm_dtype or (
        "bfloat16" if bf16_by_default(read_cpu_features()) else "float32"
    )
    plan = steps(args.vllm_python, args.llamacpp_python, vllm_dtype)
    names = [s.name for s in plan]
    if args.steps and not set(args.steps) <= set(names):
        parser.error(f"--steps: unknown {sorted(set(args.steps) - set(names))}; known {names}")
    plan = [s for s in plan if not args.steps or s.name in args.steps]
    if args.dry_run:
        for s in plan:
            print(f"{s.name}: python bench/{s.script} {shlex.join(s.args)}")
        return 0
    if args.source is not None:
        records = [json.loads(x) for x in args.source.read_text().splitlines() if x.strip()]
    else:
        records = run_plan(plan, args.rounds, args.settle, args.raw)
    desc = next((r["machine"] for r in records if "machine" in r), None) or machine()
    rounds = sorted({r.get("round", "1") for r in records}, key=int) or ["1"]
    by_round = [targets([r for r in records if r.get("round", "1") == n]) for n in rounds]
    for n, t in ((n, t) for n, ts in zip(rounds, by_round, strict=True) for t in ts):
        shown = (t.name, _show(t.shoal), t.peer, _show(t.peer_value), _show(t.ratio), t.bound)
        keys = ("target", "shoal", "peer", "peer_value", "ratio", "bound", "verdict")
        line = {k: v.replace(" ", "_") for k, v in zip(keys, (*shown, verdict(t)), strict=True)}
        emit("cpu_target", {"round": n, **line, "machine": desc}, args.out)
    print(table(by_round, desc, setups(records)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
