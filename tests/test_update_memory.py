"""A weight update gives back the host memory it used (issue 29, item 5; heap.py).

Each update reads the checkpoint and builds the new weights beside the serving ones; without a
trim, glibc keeps what the update freed, and RSS climbed 2.84 -> 4.08 -> 4.60 GB over two
updates of SmolLM2's 538 MB checkpoint. Here a random Llama of ~200 MB in tensors of 1-6 MB
(SmolLM2's are 1-3.5 MB: under glibc's 32 MB ceiling of the mmap threshold, so freed ones
stay in the heap) is updated ten times in a fresh process, which prints its RSS after each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_model import make_tiny_model_folder

from shoal.heap import trim_host_heap

SCRIPT = """
import asyncio, json, sys
from shoal import Engine

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

async def main(folder):
    async with Engine(folder, kv_cache_tokens=1024, num_threads=1) as engine:
        await engine.generate("Hello", max_new_tokens=4).result()
        figures = [rss_mb()]
        for _ in range(10):
            outcome = await engine.update_weights_from_disk(folder)
            assert outcome.success, outcome.message
            figures.append(rss_mb())
        print(json.dumps(figures))

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def medium_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(
        tmp_path_factory.mktemp("medium-llama"),
        hidden_size=512,
        intermediate_size=1536,
        num_heads=8,
        num_kv_heads=4,
        num_layers=14,
        vocab_size=512,
        tie=False,
    )


def rss_over_updates(folder: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_ten_updates_hold_rss_within_ten_percent_of_the_first(medium_folder: Path) -> None:
    figures = rss_over_updates(medium_folder)
    after_first, after_tenth = figures[1], figures[-1]
    assert after_tenth <= 1.10 * after_first, figures
    assert max(figures[1:]) <= 1.10 * after_first, figures


def test_trim_runs_where_the_c_library_has_it() -> None:
    """glibc (every Linux CI here) has malloc_trim; elsewhere the trim says it did nothing."""
    assert trim_host_heap() is sys.platform.startswith("linux")
