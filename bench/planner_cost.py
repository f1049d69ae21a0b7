"""The scheduler's and cache manager's cost of a steady decode step, alone: no asyncio, no
tokenizer, no executor (bench/host_cost.py measures the whole host).

    python bench/planner_cost.py                       # batches 1 16 32 64 256, columns on
    python bench/planner_cost.py --columns off         # the per-request code at every size
    python bench/planner_cost.py --smoke               # seconds: the test's run

B requests of 16-token prompts decode together through the real `Planner`, `CacheManager`
and `KVCache` (page size 16; each extension at a page boundary is the cache manager's real
work); a result is B copies of one token, handed back in launch order with up to two
launches in flight, as the scheduler does. After every request runs, `--steps` steps are
timed with the process's CPU clock. `--columns off` raises the decode set's minimum
(actors/scheduler/decode_set.py, `MIN_MEMBERS`) past any batch, so the per-request code plans.

    planner_cost batch=<B> columns=<on|off> steps=<K> us_per_step=<x> us_per_seq=<x>
        decode_set=<built|none> machine=<desc>
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

from bench_format import emit, machine

from shoal.actors.cache_manager.cache_manager import CacheManager
from shoal.actors.executor_messages import Launch
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Admit, StepDone
from shoal.actors.scheduler import decode_set
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.request import PlannerConfig
from shoal.cache.kv import KVCache
from shoal.params import SamplingParams

PAGE_SIZE = 16
PROMPT = tuple(range(3, 19))
MAX_INFLIGHT = 2


def step_cost(batch: int, steps: int) -> tuple[float, bool]:
    """CPU seconds per steady step of `batch` decodes; whether a decode set planned them."""
    max_pages = -(-(len(PROMPT) + steps + 64) // PAGE_SIZE)
    kv = KVCache(
        num_pages=batch * max_pages,
        page_size=PAGE_SIZE,
        num_rows=batch,
        max_pages_per_row=max_pages,
    )
    cache = CacheManager(kv, Mailbox("cache"), Mailbox("scheduler"), strict=False)
    planner = Planner(PlannerConfig(batch, 512, 2048, (2,), page_size=PAGE_SIZE))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=steps + 32, ignore_eos=True)
    for i in range(batch):
        planner.add(Admit(f"r{i}", PROMPT, sampling, 0))
    launched: deque[Launch] = deque()

    def turn() -> int:
        """Plan and launch if the pipeline has room, else take the oldest result back;
        the decodes launched (0: a result was taken)."""
        if len(launched) < MAX_INFLIGHT and not planner.plan_pending:
            request = planner.propose(0)
            if request is not None:
                launch = planner.apply_plan(cache.plan(request))
                if launch is not None:
                    launched.append(launch)
                    return len(launch.decode_rows)
        done = launched.popleft()
        sampled = len(done.decode_rows) + sum(s.sample for s in done.seqs)
        planner.process(StepDone(done.batch_id, (5,) * sampled))
        planner.take_steady()
        return 0

    while turn() != batch:  # until a step decodes every request
        pass
    start = time.process_time()
    timed = 0
    while timed < steps:
        timed += turn() == batch
    seconds = time.process_time() - start
    return seconds / steps, planner.steady.decode_set is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--columns", choices=("on", "off"), default="on")
    parser.add_argument("--smoke", action="store_true", help="batches 1 and 32, 50 steps")
    parser.add_argument("--out", type=Path, help="append each line as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.steps = [1, 32], 50
    if args.columns == "off":
        decode_set.MIN_MEMBERS = max(args.batches) + 1
    desc = machine()
    for batch in args.batches:
        seconds, built = step_cost(batch, args.steps)
        line = {
            "batch": batch,
            "columns": args.columns,
            "steps": args.steps,
            "us_per_step": round(seconds * 1e6, 2),
            "us_per_seq": round(seconds * 1e6 / batch, 3),
            "decode_set": "built" if built else "none",
            "machine": desc,
        }
        emit("planner_cost", line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
