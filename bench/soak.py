"""A soak: a shoal server under 16 concurrent clients for an hour, its resources every minute.

    python bench/soak.py                       # 60 minutes, 16 clients, the bundled SmolLM2
    python bench/soak.py --minutes 2 --clients 4 --model path/to/folder   # a short one

It starts `python -m shoal serve` in its own process group and drives it with `--clients`
clients, each looping at random over what real clients do (bench/soak_clients.py: streamed and
plain completions, /generate streams with logprobs, sessions over HTTP and the websocket,
clients that leave mid-stream, aborts by rid), and beside them one task that flushes the
cache every `--flush-every-s` and one that reloads the weights from disk every
`--update-every-s` (the served folder itself).

Every minute (`--sample-every-s`) one line: the server process's RSS, open descriptors
(and of them sockets), threads, and the operations done and failed so far. At the end the
clients stop, the engine must come idle, and a flush must leave every page and row free, no
session kept, no HTTP request open and the descriptors where they were before the first
client; then one summary line. For RSS, descriptors and threads after the warm-up: `drift`, the
median of the last third of the samples against the median of the first third (a leak grows
it; a weight update's momentary second copy of the weights, caught by a sample now and then,
does not), `peak` and the spread (max - min over the first third's median); `flat` is whether
RSS and threads drifted less than `--flat`; `leaked`, what was left.
Exit status 0 when flat and nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_format import emit, machine
from soak_clients import Tally, client_loop


@dataclass(frozen=True)
class Sample:
    minute: float
    rss_mb: float
    fds: int
    sockets: int
    threads: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(pid: int, minute: float) -> Sample:
    rss_kb, threads = 0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    fds = sockets = 0
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        fds += 1
        with contextlib.suppress(OSError):
            sockets += os.readlink(entry).startswith("socket:")
    return Sample(round(minute, 2), round(rss_kb / 1024, 1), fds, sockets, threads)


async def every(
    period_s: float, path: str, body: dict[str, Any], base: str, tally: Tally, stop: asyncio.Event
) -> None:
    """POST `path` every `period_s` until stopped; a flush refused as not idle (409) counts
    as done: refusing is its documented answer under load."""
    kind = path.strip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
            if stop.is_set():
                return
            try:
                async with http.post(base + path, json=body) as r:
                    await r.read()
                    if r.status not in (200, 409):
                        raise RuntimeError(f"{path} answered {r.status}")
                tally.done[kind] += 1
            except Exception as exc:
                tally.fail(kind, f"{type(exc).__name__}: {exc}")


async def wait_ready(base: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    began = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - began < timeout_s:
            if proc.returncode is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(base + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout_s}s")


async def settle(base: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the engine is idle, flush, and return /get_server_info."""
    async with aiohttp.ClientSession() as http:
        began = time.monotonic()
        info: dict[str, Any] = {}
        while time.monotonic() - began < timeout_s:
            async with http.get(base + "/get_server_info") as r:
                info = await r.json()
            if info["idle"] and info["open_http_requests"] == 0:
                break
            await asyncio.sleep(0.5)
        async with http.post(base + "/flush_cache", json={}) as r:
            await r.read()
        async with http.get(base + "/get_server_info") as r:
            return dict(await r.json())


def leaks(info: dict[str, Any], fds_before: int, fds_after: int) -> list[str]:
    cache = info["cache"]
    found = []
    if not info["idle"]:
        found.append("engine not idle")
    if info["open_http_requests"]:
        found.append(f"{info['open_http_requests']} HTTP requests open")
    if cache["free_pages"] != cache["total_pages"]:
        found.append(f"{cache['total_pages'] - cache['free_pages']} pages held")
    if cache["free_rows"] != cache["total_rows"]:
        found.append(f"{cache['total_rows'] - cache['free_rows']} rows held")
    if cache["sessions"]:
        found.append(f"{cache['sessions']} sessions keep KV")
    if fds_after > fds_before:
        found.append(f"{fds_after - fds_before} more descriptors than before the clients")
    return found


def counts(counter: Counter[str]) -> str:
    """Counter({"chat": 3, "leave": 1}) -> "chat:3,leave:1" (one key=value field)."""
    return ",".join(f"{kind}:{n}" for kind, n in sorted(counter.items()))


def thirds(samples: list[Sample], name: str) -> tuple[float, float]:
    """The medians of a figure over the first and the last third of the samples."""
    values = [float(getattr(s, name)) for s in samples]
    third = max(1, len(values) // 3)
    return statistics.median(values[:third]), statistics.median(values[-third:])


def drift(samples: list[Sample], name: str) -> float:
    first, last = thirds(samples, name)
    return round((last - first) / max(first, 1.0), 4)


def spread(samples: list[Sample], name: str) -> float:
    values = [float(getattr(s, name)) for s in samples]
    first, _ = thirds(samples, name)
    return round((max(values) - min(values)) / max(first, 1.0), 4)


async def soak(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "shoal", "serve", "--port", str(port)]
    cmd += ["--num-threads", str(args.threads)]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL if args.quiet else None,
        env=env,
        start_new_session=True,
    )
    try:
        await wait_ready(base, proc, args.startup_timeout_s)
        async with (
            aiohttp.ClientSession() as http,
            http.get(base + "/get_model_info") as r,
        ):
            folder = (await r.json())["model_path"]
        fds_before = sample(proc.pid, 0).fds
        tally = Tally()
        stop = asyncio.Event()
        began = time.monotonic()
        until = began + args.minutes * 60
        tasks = [
            asyncio.create_task(client_loop(i, base, until, tally, stop))
            for i in range(args.clients)
        ]
        tasks.append(asyncio.create_task(every(args.flush_every_s, "/flush_cache", {}, base,
                                               tally, stop)))  # fmt: skip
        update = {"model_path": folder}
        tasks.append(asyncio.create_task(every(args.update_every_s, "/update_weights_from_disk",
                                               update, base, tally, stop)))  # fmt: skip
        samples: list[Sample] = []
        while (now := time.monotonic()) < until:
            await asyncio.sleep(min(args.sample_every_s, until - now))
            s = sample(proc.pid, (time.monotonic() - began) / 60)
            samples.append(s)
            line = {
                "minute": s.minute,
                "rss_mb": s.rss_mb,
                "fds": s.fds,
                "sockets": s.sockets,
                "threads": s.threads,
                "ops": sum(tally.done.values()),
                "failed": sum(tally.failed.values()),
                "machine": machine(),
            }
            emit("soak", line, args.out)
        stop.set()
        await asyncio.gather(*tasks)
        info = await settle(base)
        await asyncio.sleep(2.0)  # closed client sockets leave the server's table
        fds_after = sample(proc.pid, 0).fds
        after = [s for s in samples if s.minute > args.warm_up_minutes] or samples[-1:]
        flat = all(abs(drift(after, name)) <= args.flat for name in ("rss_mb", "threads"))
        left = leaks(info, fds_before, fds_after)
        summary = {
            "minutes": args.minutes,
            "clients": args.clients,
            "ops": counts(tally.done),
            "failed": counts(tally.failed) or "none",
            "rss_drift": drift(after, "rss_mb"),
            "rss_peak_mb": max(s.rss_mb for s in after),
            "rss_spread": spread(after, "rss_mb"),
            "threads_drift": drift(after, "threads"),
            "threads_spread": spread(after, "threads"),
            "fds_drift": drift(after, "fds"),
            "fds_spread": spread(after, "fds"),
            "fds_before": fds_before,
            "fds_after": fds_after,
            "flat": flat,
            "leaked": ",".join(left).replace(" ", "_") or "nothing",
            "machine": machine(),
        }
        emit("soak_summary", summary, args.out)
        for error in tally.errors:
            print(f"# {error}", file=sys.stderr)
        return 0 if flat and not left else 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--sample-every-s", type=float, default=60.0)
    parser.add_argument("--flush-every-s", type=float, default=30.0)
    parser.add_argument("--update-every-s", type=float, default=120.0)
    parser.add_argument("--warm-up-minutes", type=float, default=5.0)
    parser.add_argument("--flat", type=float, default=0.05, help="allowed drift after warm-up")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--quiet", action="store_true", help="hide the server's log")
    parser.add_argument("--out", type=Path, default=None, help="append each line as JSON")
    args = parser.parse_args(argv)
    return asyncio.run(soak(args))


if __name__ == "__main__":
    raise SystemExit(main())
