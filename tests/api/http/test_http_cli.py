"""`python -m shoal serve`: prints its address when ready, ends open streams and exits cleanly
on SIGINT, SIGTERM and SIGHUP (which killed it at once, cutting streams mid-chunk)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from served import chat, sse_events


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"]
)
async def test_serve_streams_then_shuts_down_cleanly(
    tiny_folder: Path, sig: signal.Signals, prebuilt_cpu_kernels: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shoal", "serve", "--model", str(tiny_folder), "--port", "0",
        "--served-model-name", "tiny", "--api-key", "k",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found is not None, line
        url = found[0]
        headers = {"Authorization": "Bearer k"}
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.get(url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "tiny"
            body = chat("hi", max_tokens=900, ignore_eos=True, stream=True)
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the stream is open
                proc.send_signal(sig)
                events = await asyncio.wait_for(sse_events(resp), 30)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "service_unavailable", events[-2]
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert b"shutting down" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
