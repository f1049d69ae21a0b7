"""llama.cpp's side of bench/speculative.py, run by the Python of its own environment
(llama-cpp-python built for this CPU): one stream of each workload's first `--prompts` prompts
one after another, greedy, with prompt-lookup decoding (`LlamaPromptLookupDecoding`) and
without, on the same GGUF. Prints one JSON line per (workload, lookup, prompt) with its output
tokens and seconds.

    $LLAMA_PY bench/llamacpp_lookup.py --gguf FILE --workload copy prose --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from speculative_prompts import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=1, help="the workload's first N prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-pred-tokens", type=int, default=10)
    args = parser.parse_args()
    for lookup in (False, True):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens) if lookup else None
        llm = Llama(
            model_path=args.gguf,
            n_ctx=2048,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            draft_model=draft,
            verbose=False,
        )
        llm.create_chat_completion(  # warm up
            messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
        )
        for workload in args.workload:
            for prompt in range(args.prompts):
                messages = WORKLOADS[workload](prompt)
                started = time.perf_counter()
                answer = llm.create_chat_completion(
                    messages=messages, max_tokens=args.max_tokens, temperature=0.0, top_k=1
                )
                seconds = time.perf_counter() - started
                tokens = answer["usage"]["completion_tokens"]
                line = {"workload": workload, "lookup": lookup, "prompt": prompt}
                line |= {"tokens": tokens, "seconds": seconds}
                print(json.dumps(line), flush=True)
        del llm


if __name__ == "__main__":
    main()
