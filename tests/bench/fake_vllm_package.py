"""A fake `vllm` package, written to a folder and importable by the subprocesses the benchmarks
start (PYTHONPATH): the offline worker's LLM and the OpenAI server's stand-in, each writing what
it was given to FAKE_VLLM_RECORD.

    record = fake_vllm(tmp_path, monkeypatch)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

FAKE_VLLM = {
    "__init__.py": """
        import json, os, sys, time
        __version__ = "0.0fake"

        class SamplingParams:
            def __init__(self, **fields):
                self.fields = fields

        class _Output:
            def __init__(self, n):
                self.outputs = [type("Completion", (), {"token_ids": [7] * n})()]

        class LLM:
            def __init__(self, model, dtype, max_model_len):
                if os.environ.get("FAKE_VLLM_FAIL"):
                    raise RuntimeError("fake vLLM refuses to start")
                self.record = {"model": model, "dtype": dtype, "max_model_len": max_model_len,
                               "env_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                               "sys_path": sys.path, "cwd": os.getcwd(), "calls": []}

            def generate(self, prompts, params, use_tqdm=True):
                assert len(prompts) == len(params) and not use_tqdm
                self.record["calls"].append([[p["prompt_token_ids"], s.fields]
                                             for p, s in zip(prompts, params)])
                with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
                    json.dump(self.record, f)
                time.sleep(0.01)
                return [_Output(s.fields["max_tokens"]) for s in params]
    """,
    "inputs.py": """
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
    """,
    "platforms.py": """
        class current_platform:
            device_type = "cpu"
    """,
    "entrypoints/__init__.py": "",
    "entrypoints/openai/__init__.py": "",
    "entrypoints/openai/api_server.py": """
        # A stand-in for vLLM's OpenAI server: /v1/models, streaming /v1/completions that
        # sends max_tokens chunks and a usage chunk when asked with ignore_eos and min_tokens.
        import argparse, json, os
        from aiohttp import web

        parser = argparse.ArgumentParser()
        for flag in ("--model", "--dtype", "--max-model-len", "--host", "--port"):
            parser.add_argument(flag)
        args = parser.parse_args()
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump({"argv": vars(args), "cwd": os.getcwd(),
                       "env_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}, f)

        async def models(request):
            return web.json_response({"data": [{"id": args.model}]})

        def event(data):
            return b"data: " + json.dumps(data).encode() + b"\\n\\n"

        async def completions(request):
            body = await request.json()
            n = body["max_tokens"]
            if not (body.get("ignore_eos") and body.get("min_tokens") == n and body["stream"]):
                return web.json_response({"error": "asked not as serving.py asks"}, status=400)
            response = web.StreamResponse()
            await response.prepare(request)
            for i in range(n):
                choice = {"text": " w", "finish_reason": "length" if i == n - 1 else None}
                await response.write(event({"choices": [choice]}))
            await response.write(event({"choices": [], "usage": {"completion_tokens": n}}))
            await response.write(b"data: [DONE]\\n\\n")
            return response

        app = web.Application()
        app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
        web.run_app(app, host=args.host, port=int(args.port), print=None)
    """,
}


def fake_vllm(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake `vllm` package under root, importable by subprocesses (PYTHONPATH); the file
    each fake writes what it was given to (FAKE_VLLM_RECORD)."""
    for name, text in FAKE_VLLM.items():
        path = root / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.setenv("PYTHONPATH", str(root))
    record = root / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "SHOAL_BENCH_VLLM_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    return record
