"""Prefill/decode disaggregation against one server, on this machine: TTFT, ITL and the KV
transfer rate (docs/disaggregation.md).

    python bench/disagg.py                       # c = 1 and 8, the bundled SmolLM2
    python bench/disagg.py --concurrency 1 4 16 --backend local
    python bench/disagg.py --smoke

Both set-ups get the same cores: one shoal server with --threads of them, or a prefill and a
decode server with half each behind SGLang's router (`sglang_router.launch_router
--pd-disaggregation`), KV moved by Mooncake's transfer engine over loopback TCP. The load
is bench/serving.py's (streaming /v1/completions, seeded random-word prompts). Lines:

    serving system=shoal ...                     (bench/serving.py's line)
    serving system=shoal-pd ...
    disagg transfers=<n> bytes=<n> prefill_write_gb_per_s=<x> decode_wait_ms_mean=<x>

`prefill_write_gb_per_s`: the bytes the prefill server wrote over the seconds its writes
took; `decode_wait_ms_mean`: from the decode server asking for a room's KV to having it
(it includes waiting for the prefill server to compute the prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from launch import LaunchConfig, free_port, launch
from serving_load import run_load
from serving_requests import workload

ROUTER_READY_S = 60.0


@contextlib.asynccontextmanager
async def router(prefill: str, bootstrap_port: int, decode: str) -> AsyncIterator[str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--pd-disaggregation", "--prefill", prefill, str(bootstrap_port),
        "--decode", decode, "--worker-startup-check-interval", "1",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_S
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/readiness") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.25)
            else:
                raise TimeoutError(f"the router was not ready in {ROUTER_READY_S}s")
        yield url
    finally:
        proc.terminate()
        await proc.wait()


async def transferred(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/get_server_info") as r:
        return dict((await r.json())["disaggregation_transferred"])


async def amain(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 (GGUF)")
    parser.add_argument("--threads", type=int, default=2, help="in all; PD: half a server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=0, help="per run (0: max(8, 2 x c))")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192), help="words")
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 96), help="tokens")
    parser.add_argument("--backend", choices=["mooncake", "local"], default="mooncake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="c = 1 2, 4 requests, short")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests = [1, 2], 4
        args.prompt_len, args.output_len = (4, 12), (2, 6)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

    async def runs(label: str, base_url: str) -> None:
        for level in args.concurrency:
            n = args.requests or max(8, 2 * level)
            work = workload(n, args.seed, args.prompt_len, args.output_len)
            line = await run_load(
                base_url, "shoal", work, "concurrency", level, args.seed, [], False
            )
            line["system"] = label
            print("serving " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)

    async with launch("shoal", LaunchConfig(args.model, args.threads)) as one:
        await runs("shoal", one.base_url)
    half = max(1, args.threads // 2)
    bootstrap_port = free_port()
    pd_flags = ("--disaggregation-transfer-backend", args.backend)
    prefill_config = LaunchConfig(
        args.model,
        half,
        shoal_args=(
            "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(bootstrap_port), *pd_flags,
        ),
    )  # fmt: skip
    decode_config = LaunchConfig(
        args.model, half, shoal_args=("--disaggregation-mode", "decode", *pd_flags)
    )
    async with (
        launch("shoal", prefill_config) as prefill,
        launch("shoal", decode_config) as decode,
        router(prefill.base_url, bootstrap_port, decode.base_url) as url,
    ):
        await runs("shoal-pd", url)
        sent, received = await transferred(prefill.base_url), await transferred(decode.base_url)
    rate = sent["bytes"] / sent["seconds"] / 1e9 if sent["seconds"] else 0.0
    wait = 1000 * received["seconds"] / received["transfers"] if received["transfers"] else 0.0
    print(
        f"disagg transfers={received['transfers']} bytes={received['bytes']} "
        f"prefill_write_gb_per_s={rate:.3f} decode_wait_ms_mean={wait:.1f} "
        f"backend={args.backend}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(argv))


if __name__ == "__main__":
    sys.exit(main())
