"""bench/offline.py's vLLM run, in vLLM's own environment (started by bench/vllm_peer.py).

    echo '{"folder": ..., "dtype": "float32", "threads": 2, "max_model_len": 2048,
           "warm_up": [[ids], n], "work": [[[ids], n], ...]}' | python vllm_offline_worker.py

Reads one job (JSON, bench/vllm_peer.py's OfflineJob) from stdin; constructs vllm.LLM on the
folder (setup_s: import and construction, minutes on a CPU: torch.compile warm-up); runs the
warm-up request untimed; then submits every request of `work` in one `generate` call (token
ids in, min_tokens = max_tokens = its output length, ignore_eos, greedy) and times it. Prints
progress lines starting "# vllm" and, last, one line:

    vllm_offline_result {"tokens": <produced>, "seconds": <s>, "setup_s": <s>, "setup": <desc>}

setup: <device>-<dtype>-vllm<version>, + "-iomp" when Intel's OpenMP is preloaded.

Only the standard library and vllm are imported: bench/ is taken off sys.path first, so that
its scripts (kernels.py, ...) shadow nothing of vLLM's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "vllm_offline_result "  # as in bench/vllm_peer.py

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def progress(text: str) -> None:
    print(f"# vllm: {text}", flush=True)


def generate(llm: Any, work: list[list[Any]]) -> int:
    """Every request of `work` in one call; the output tokens produced."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids, _ in work]
    params = [
        SamplingParams(min_tokens=n, max_tokens=n, ignore_eos=True, temperature=0.0)
        for _, n in work
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(out.outputs[0].token_ids) for out in outputs)


def main() -> int:
    job = json.loads(sys.stdin.read())
    progress(f"constructing the engine on {job['folder']} (minutes: torch.compile warm-up)")
    began = time.perf_counter()
    import vllm
    from vllm.platforms import current_platform

    llm = vllm.LLM(model=job["folder"], dtype=job["dtype"], max_model_len=job["max_model_len"])
    setup_s = time.perf_counter() - began
    progress(f"engine ready in {setup_s:.1f}s; warm-up, then {len(job['work'])} requests")
    generate(llm, [job["warm_up"]])
    began = time.perf_counter()
    tokens = generate(llm, job["work"])
    seconds = time.perf_counter() - began
    setup = f"{current_platform.device_type}-{job['dtype']}-vllm{vllm.__version__}"
    if "libiomp5" in os.environ.get("LD_PRELOAD", ""):
        setup += "-iomp"
    result = {"tokens": tokens, "seconds": seconds, "setup_s": setup_s, "setup": setup}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this module
    sys.exit(main())
