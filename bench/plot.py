"""Charts from bench/serving.py's JSON lines: output tokens/s against load per system, and
TTFT / ITL percentiles (mean, median, p99) per system and load.

    python bench/serving.py --out bench/serving.jsonl
    python bench/plot.py bench/serving.jsonl --outdir bench      # serving_throughput.png,
                                                                  # serving_latency.png
Prints one line per chart written:
    plot chart=<path> systems=<a,b> runs=<n>
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"shoal": "tab:blue", "llamacpp": "tab:orange"}


def read(paths: list[Path]) -> list[dict[str, Any]]:
    """The serving lines of the files, the last one kept for each (system, mode, load)."""
    latest: dict[tuple[str, str, float], dict[str, Any]] = {}
    for path in paths:
        for text in path.read_text().splitlines():
            if text.strip():
                line = json.loads(text)
                if "out_tok_per_s" in line:
                    latest[(line["system"], line["mode"], float(line["load"]))] = line
    return [latest[k] for k in sorted(latest)]


def by_system(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        grouped[line["system"]].append(line)
    return dict(grouped)


def _load_axis(ax: Any, lines: list[dict[str, Any]]) -> None:
    """Log-2 load axis labelled with the loads that were run (1 4 16 64, not powers of 2)."""
    loads = sorted({float(r["load"]) for r in lines})
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}" for x in loads])
    ax.minorticks_off()
    mode = lines[0]["mode"]
    ax.set_xlabel("concurrent requests" if mode == "concurrency" else "request rate (req/s)")


def throughput_chart(lines: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for system, runs in by_system(lines).items():
        loads = [r["load"] for r in runs]
        ax.plot(
            loads, [r["out_tok_per_s"] for r in runs], "o-", label=system, color=COLORS.get(system)
        )
        for r in runs:
            ax.annotate(
                f"{r['out_tok_per_s']:.0f}",
                (r["load"], r["out_tok_per_s"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    _load_axis(ax, lines)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def latency_chart(lines: list[dict[str, Any]], path: Path, title: str) -> None:
    metrics = ("ttft", "itl")
    systems = by_system(lines)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    stats = ("mean", "median", "p99")
    for ax, metric in zip(axes, metrics, strict=True):
        for system, runs in systems.items():
            loads = [r["load"] for r in runs]
            for stat, style in zip(stats, (":", "-", "--"), strict=True):
                ax.plot(
                    loads,
                    [r[f"{metric}_ms_{stat}"] for r in runs],
                    style,
                    marker="o",
                    color=COLORS.get(system),
                    label=f"{system} {stat}",
                )
        ax.set_yscale("log")
        _load_axis(ax, lines)
        ax.set_ylabel(f"{metric.upper()} (ms, log)")
        ax.set_title(f"{metric.upper()}: mean (dotted), median (solid), p99 (dashed)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("jsonl", type=Path, nargs="+")
    parser.add_argument("--outdir", type=Path, default=Path("bench"))
    parser.add_argument("--title", default="SmolLM2-135M, 2-core CPU")
    args = parser.parse_args(argv)
    lines = read(args.jsonl)
    if not lines:
        parser.error("no serving lines in the input")
    args.outdir.mkdir(parents=True, exist_ok=True)
    systems = ",".join(by_system(lines))
    for name, draw in (("throughput", throughput_chart), ("latency", latency_chart)):
        path = args.outdir / f"serving_{name}.png"
        draw(lines, path, args.title)
        print(f"plot chart={path} systems={systems} runs={len(lines)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
