"""vLLM as a peer for the benchmarks: find a Python that can import it, the environment it
runs in, and bench/vllm_offline_worker.py's protocol, run from shoal's environment.

vLLM lives in its own virtual environment (its torch differs from shoal's), so it always runs
as a subprocess of that environment's Python:

    python, reason = find_python(args.vllm_python)   # None and why, when there is none
    result = run_offline(python, OfflineJob(folder, "float32", 2, 2048, warm_up, work))

Which Python: the one given (`--vllm-python`), else $SHOAL_BENCH_VLLM_PYTHON, else this
interpreter if it can import vllm. Every run gets `vllm_env(threads, python)`: the CPU
backend's threads bound to cores 0 .. threads-1, a 4 GiB KV cache, no hub downloads, logs on
stderr, and Intel's OpenMP preloaded when the environment has it (`<env>/lib/libiomp5.so`, as
vLLM's CPU install guide asks; it warns without it).
Both are started in their own process group, stopped as a group, and from a neutral working
directory (nothing of shoal's on their sys.path).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

PYTHON_ENV = "SHOAL_BENCH_VLLM_PYTHON"
WORKER = Path(__file__).resolve().parent / "vllm_offline_worker.py"
RESULT_PREFIX = "vllm_offline_result "  # the worker's one result line (JSON after it)
PROGRESS_PREFIX = "# vllm"  # the worker's own progress lines, passed on to stderr
IMPORT_CHECK = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def vllm_env(threads: int, python: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with vLLM's CPU settings for a run with
    `python`; a variable already set there wins."""
    env = dict(os.environ if base is None else base)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # <env>/bin/python
    if iomp.is_file():
        env.setdefault("LD_PRELOAD", str(iomp))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cannot_import(python: str) -> str | None:
    """Why `python` cannot run vLLM, or None when it can import it."""
    try:
        done = subprocess.run(
            [python, "-c", IMPORT_CHECK],
            capture_output=True,
            timeout=120,
            cwd=tempfile.gettempdir(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} does not run ({exc.__class__.__name__}: {exc})"
    if done.returncode != 0:
        return f"{python} cannot import vllm"
    return None


def find_python(explicit: str | None) -> tuple[str | None, str]:
    """(the vLLM Python, "") or (None, why there is none)."""
    given = explicit or os.environ.get(PYTHON_ENV)
    if given:
        source = "--vllm-python" if explicit else f"${PYTHON_ENV}"
        reason = cannot_import(given)
        return (None, f"{reason} (from {source})") if reason else (given, "")
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, ""
    return None, (
        f"this Python cannot import vllm; pass --vllm-python PATH or set ${PYTHON_ENV} to "
        "the python of an environment with vLLM (bench/README.md)"
    )


@dataclass(frozen=True)
class OfflineJob:
    """What the worker reads from stdin, as JSON."""

    folder: str  # a Hugging Face model folder
    dtype: str  # "float32", ...
    threads: int
    max_model_len: int
    warm_up: tuple[list[int], int]  # (prompt ids, output tokens), untimed
    work: list[tuple[list[int], int]]  # every request, submitted in one generate call


@dataclass(frozen=True)
class OfflineResult:
    """The worker's result line: output tokens produced, the timed generate's seconds, the
    seconds to import vLLM and construct its engine (not timed), and a setup description."""

    tokens: int
    seconds: float
    setup_s: float
    setup: str


def parse_result(line: str) -> OfflineResult | None:
    if not line.startswith(RESULT_PREFIX):
        return None
    fields = json.loads(line[len(RESULT_PREFIX) :])
    return OfflineResult(
        int(fields["tokens"]),
        float(fields["seconds"]),
        float(fields["setup_s"]),
        str(fields["setup"]),
    )


def stop_group(proc: subprocess.Popen[str], grace_s: float) -> None:
    """SIGTERM to the process group `proc` leads, then SIGKILL to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_offline(python: str, job: OfflineJob) -> OfflineResult:
    """Run the worker on `job`; its result, or RuntimeError with the tail of its output."""
    proc = subprocess.Popen(
        [python, str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=vllm_env(job.threads, python),
        cwd=tempfile.gettempdir(),
        start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    result = None
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(asdict(job)))
        proc.stdin.close()
        for line in proc.stdout:
            parsed = parse_result(line)
            if parsed is not None:
                result = parsed
            elif line.startswith(PROGRESS_PREFIX):
                print(line.rstrip(), file=sys.stderr, flush=True)
            tail.append(line.rstrip())
        proc.wait()
    finally:
        stop_group(proc, grace_s=30)
    if result is None:
        lines = "\n".join(tail)
        raise RuntimeError(f"the vLLM worker exited with {proc.returncode} and no result:\n{lines}")
    return result
