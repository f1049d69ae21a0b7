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
rebuild them. The targets and their bounds are read from the lines by cpu_target_rules.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_format import emit, machine
from cpu_target_rules import Record, Target, targets, verdict

from shoal.kernels.cpu_features import bf16_by_default, read_cpu_features

BENCH = Path(__file__).resolve().parent
KINDS = ("offline", "serving", "quality")  # the lines a step's output is read for


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


def _show(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


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
