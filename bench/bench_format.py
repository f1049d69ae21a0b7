"""What every benchmark shares: the machine's name, the fixed `key=value` lines (also appended
as JSON to `--out`), and the offline runs' one-line report."""

from __future__ import annotations

import json
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.kernels.cpu_features import read_cpu_features

WARM_UP_PROMPT = list(range(100, 116))


def machine() -> str:
    """The CPU's model (its family and model numbers where known) and features
    (kernels/cpu_features.py), cores, torch, threads; the GPU first where there is one:
    AMD_EPYC_family_26_model_2-avx2+avx512f+...-x86_64-2cpu-..."""
    threads = torch.get_num_threads()
    cpu = read_cpu_features()
    name = " ".join(filter(None, (cpu.model, cpu.generation.replace(",", "")))).replace(" ", "_")
    desc = (
        f"{name}-{cpu.isa()}-{platform.machine()}-{os.cpu_count()}cpu"
        f"-torch{torch.__version__}-threads{threads}"
    )
    if torch.cuda.is_available():
        desc = torch.cuda.get_device_name().replace(" ", "_") + "-" + desc
    return desc


def fixed_mixed_prefill() -> int | None:
    """One mixed-prefill cap for every engine a bench compares in one process: the CPU's 64 of
    before the start measured it (unset, each start measures its own, resolve_options.py, and
    two could differ); a GPU's own (none)."""
    return None if torch.cuda.is_available() else 64


def workload(
    n: int, vocab: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(n)
    ]


def emit(kind: str, line: dict[str, Any], out: Path | None) -> None:
    print(f"{kind} " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class Setup:
    """How a system was set up: its description, and the seconds that took (not timed)."""

    desc: str
    seconds: float


def report(
    system: str, n: int, tokens: int, seconds: float, setup: Setup, desc: str, out: Path | None
) -> float:
    line = {
        "system": system,
        "requests": n,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        "setup_s": round(setup.seconds, 1),
        "setup": setup.desc,
        "machine": desc,
    }
    emit("offline", line, out)
    return tokens / seconds


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
