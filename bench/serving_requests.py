"""bench/serving.py's requests: seeded random-word prompts (text, so any server takes them)
with their output lengths, the `/v1/completions` body each system is sent (shoal and vLLM get
`ignore_eos`, vLLM also `min_tokens`; llama.cpp, which has no such field, gets the
end-of-sequence ids banned with `logit_bias` and `min_tokens`), and what one request measured."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it his an are were which be this "
    "has had not but they one their or have been its after first new two also who more other "
    "time year city river music team world state school house water light story night field "
    "people small great early north south under between during several number family system "
    "village court market island forest garden window morning paper station energy question"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def workload(n: int, seed: int, prompt: Sequence[int], output: Sequence[int]) -> list[Request]:
    """Seeded random prompts (words; about 1.2 tokens each for SmolLM2) and output lengths."""
    rng = random.Random(seed)
    return [
        Request(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt))),
            rng.randint(*output),
        )
        for _ in range(n)
    ]


def request_body(system: str, model: str, req: Request, eos_ids: Sequence[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if system in ("shoal", "vllm"):
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
        if system == "vllm":
            body["min_tokens"] = req.max_tokens
    elif system == "llamacpp":
        body["min_tokens"] = req.max_tokens
        if eos_ids:
            body["logit_bias"] = {str(t): -100.0 for t in eos_ids}
    return body
