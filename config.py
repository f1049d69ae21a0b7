"""Engine configuration: the user's options, each with its default and the line that says what it
sets (resolve_options.py resolves them once at start into narrow sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import UnionType
from typing import Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import torch

from shoal.disagg.peers import PrefillPeers
from shoal.limits import InputLimits

DEFAULT_LIMITS = InputLimits()
T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SESSION_TIMEOUT_S = 600.0  # a session's idle timeout when its opener names none


def option(default: T, says: str) -> T:
    """A field of EngineOptions: its default and the one line that says what it sets."""
    return field(default=default, metadata={"says": says})


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What a user may set. None means "pick for me". Each field says in one line what it sets:
    the CLI's flags are made from the fields (api/engine_flags.py) and README's table lists
    each with that line (tests/api/test_engine_flags.py checks both)."""

    page_size: int = option(16, "tokens a page of the KV cache holds")
    kv_cache_tokens: int | None = option(
        None,
        "tokens the KV cache holds, all requests together (unset: 32768 on the CPU; on CUDA "
        "what fits in 90% of the GPU memory left after the weights and a step's working "
        "memory, at most max_running_requests full contexts)",
    )
    max_running_requests: int = option(64, "requests running at once (rows of a batch)")
    chunk_size: int = option(512, "prompt tokens one request may prefill in a step")
    max_batch_tokens: int = option(2048, "tokens one step may run, prompts and decodes together")
    max_mixed_prefill_tokens: int | None = option(
        None,
        "prompt tokens a step that also decodes may take (unset: on the CPU as many as the "
        "model's matmuls compute in ~40 ms, measured at start, 64-256; no cap on a GPU; 0: up "
        "to max_batch_tokens); lower: steadier inter-token latency under load",
    )
    max_inflight: int = option(2, "batches launched ahead of their results (1: no overlap)")
    pipeline_stages: int = option(
        1, "executor stages the model's layers are split across, in order (1: one executor)"
    )
    pipeline_depth: int = option(
        1, "microbatches in flight beyond one a stage: pipeline_stages + this at most"
    )
    stage_devices: str | None = option(
        None, "each stage's device, comma-separated (unset: consecutive CUDA devices, or the CPU)"
    )
    stage_layers: str | None = option(
        None, "each stage's number of layers, comma-separated (unset: split evenly)"
    )
    context_length: int | None = option(
        None, "tokens a request may hold, prompt and output (unset: the model's)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        "weights and KV (auto: bfloat16 on CUDA and on a CPU with AMX or AVX512-BF16, else "
        "float32); on the CPU bfloat16 is the weights' and the KV's: the matmuls run on the "
        "matrix units or bfloat16 dot products, "
        "activations, norms and attention's arithmetic stay float32 (kernels/bf16_linear.py)",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "the KV cache's elements (auto: the weights' dtype; with int8 bfloat16 where the CPU "
        "takes bfloat16 weights by default, else float32); on the CPU "
        "bfloat16 halves what attention reads, float32 keeps float32's exact tokens; on CUDA "
        "only the weights' dtype",
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "where the model runs (auto: CUDA when torch sees a device)"
    )
    attention: Literal["auto", "torch", "triton", "cpu"] = option(
        "auto",
        "attention kernels (auto: triton on CUDA; on the CPU in float32 cpu, C++ decode "
        "attention and element-wise ops compiled on first use, torch when no compiler is found; "
        "else torch, the reference)",
    )
    quantization: Literal["int8"] | None = option(
        None,
        "int8: weights in blocks of 32 (a GGUF's Q4_1 kept as its 4-bit blocks, else int8), "
        "activations rounded to int16 (CPU; not token-exact, quality in bench/README.md); unset: "
        "the model's dtype",
    )
    cuda_graph_max_batch: int = option(
        128, "decode batches up to this size replay CUDA graphs (0: off)"
    )
    num_threads: int | None = option(None, "torch's CPU threads (unset: torch's choice)")
    seed: int | None = option(
        None, "the random source of requests that give no seed (unset: the OS)"
    )
    strict_integrity: bool = option(
        False,
        "an integrity violation found when idle raises instead of being logged (tests turn it on)",
    )
    prefix_cache: bool = option(
        True, "keep computed KV in the radix tree for later prompts to reuse"
    )
    max_sessions: int = option(256, "sessions open at once (more are refused)")
    max_sessions_per_client: int = option(
        64, "sessions one client (over HTTP: a peer address) may hold open at once"
    )
    max_session_timeout_s: float = option(
        3600.0, "the longest idle timeout_s a session may ask for (longer is refused)"
    )
    disaggregation_mode: Literal["null", "prefill", "decode"] = option(
        "null",
        "prefill/decode disaggregation (docs/disaggregation.md): prefill computes prompts and "
        "sends their KV to a decode server, decode receives it and generates; null: neither",
    )
    disaggregation_bootstrap_port: int = option(
        8998, "where a prefill server's bootstrap endpoint listens (0: a free port)"
    )
    disaggregation_bootstrap_host: str = option(
        "127.0.0.1",
        "where a prefill server's bootstrap endpoint listens, and the address peers reach "
        "its transfer engine at (0.0.0.0: every interface)",
    )
    disaggregation_transfer_backend: Literal["mooncake", "local"] = option(
        "mooncake",
        "what moves KV between servers: Mooncake's transfer engine, or local (an in-process "
        "copy between engines sharing a LocalFabric: tests)",
    )
    disaggregation_timeout_s: float = option(
        60.0, "how long a request's KV transfer, or a room missing a half, may wait"
    )
    disaggregation_prefill_peers: str = option(
        "127.0.0.1:8998",
        "the prefill servers' bootstrap endpoints a decode server may contact, comma-separated "
        "host:port (a request naming another is refused)",
    )
    # input limits every door shares, the Python API included (limits.py, docs/limits.md)
    max_stop_strings: int = option(DEFAULT_LIMITS.max_stop_strings, "stop strings per request")
    max_stop_chars: int = option(DEFAULT_LIMITS.max_stop_chars, "characters per stop string")
    max_stop_token_ids: int = option(
        DEFAULT_LIMITS.max_stop_token_ids, "stop token ids per request"
    )
    max_stop_regex: int = option(DEFAULT_LIMITS.max_stop_regex, "stop_regex patterns per request")
    max_stop_regex_chars: int = option(
        DEFAULT_LIMITS.max_stop_regex_chars, "characters per stop_regex pattern"
    )
    max_prompt_chars: int = option(
        DEFAULT_LIMITS.max_prompt_chars,
        "characters of a text prompt, or of all the chat messages together",
    )
    max_messages: int = option(DEFAULT_LIMITS.max_messages, "chat messages per request or turn")
    max_logit_bias: int = option(DEFAULT_LIMITS.max_logit_bias, "logit_bias entries per request")
    max_token_ids_logprob: int = option(
        DEFAULT_LIMITS.max_token_ids_logprob, "token_ids_logprob entries per request"
    )

    max_grammar_chars: int = option(
        DEFAULT_LIMITS.max_grammar_chars,
        "characters of a request's grammar (json_schema, regex, ebnf or structural_tag)",
    )
    grammar_compile_timeout_s: float = option(
        10.0, "how long a request's grammar may take to compile before it is refused (400)"
    )
    json_any_whitespace: bool = option(
        False,
        "a json_schema's output may put whitespace wherever JSON allows (off: compact JSON, "
        "one space after ':' and ',')",
    )
    grammar_cache_mb: int = option(
        256, "memory for compiled grammars, least recently used dropped first"
    )
    speculative_algorithm: Literal["ngram"] | None = option(
        None,
        "speculative decoding: ngram drafts the tokens that followed the latest earlier "
        "occurrence of a request's last tokens (its prompt and output) and verifies them in "
        "one step (unset: off)",
    )
    speculative_num_draft_tokens: int = option(
        12, "drafts one request verifies in a step at most (fewer while its drafts are refused)"
    )
    speculative_ngram_min_match_window_size: int = option(
        1, "the shortest run of a request's last tokens an ngram draft is looked up by"
    )
    speculative_ngram_max_match_window_size: int = option(
        4, "the longest run of a request's last tokens an ngram draft is looked up by"
    )
    speculative_max_running: int = option(
        8, "a step speculates only while at most this many requests run (more: off)"
    )

    def input_limits(self) -> InputLimits:
        return InputLimits(**{name: getattr(self, name) for name in InputLimits.__struct_fields__})

    def validate(self) -> None:
        self.input_limits().validate()
        for name in (
            "page_size",
            "kv_cache_tokens",
            "max_running_requests",
            "chunk_size",
            "max_batch_tokens",
            "max_inflight",
            "pipeline_stages",
            "max_sessions_per_client",
            "speculative_num_draft_tokens",
            "speculative_ngram_min_match_window_size",
            "speculative_max_running",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_mixed_prefill_tokens", "cuda_graph_max_batch", "max_sessions", "pipeline_depth",
        ):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        low, high = (
            self.speculative_ngram_min_match_window_size,
            self.speculative_ngram_max_match_window_size,
        )
        if high < low:
            raise ValueError(
                "speculative_ngram_max_match_window_size must be >= "
                f"speculative_ngram_min_match_window_size ({low}), got {high}"
            )
        if self.grammar_cache_mb < 1:
            raise ValueError(f"grammar_cache_mb must be >= 1, got {self.grammar_cache_mb}")
        for name in (
            "disaggregation_timeout_s",
            "max_session_timeout_s",
            "grammar_compile_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        PrefillPeers.parse(self.disaggregation_prefill_peers)  # ValueError saying which entry
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ValueError(
                "disaggregation_bootstrap_port must be a port (0 to 65535), got "
                f"{self.disaggregation_bootstrap_port}"
            )
        for name in ("stage_devices", "stage_layers"):
            given = getattr(self, name)
            if given is not None and len(given.split(",")) != self.pipeline_stages:
                raise ValueError(
                    f"{name} must name one entry per stage ({self.pipeline_stages}), got {given!r}"
                )
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                *most, last = ["unset" if value is None else str(value) for value in allowed]
                listed = f"{', '.join(most)} or {last}" if most else last
                raise ValueError(f"{name} must be {listed}, got {getattr(self, name)!r}")


def choices(kind: object) -> tuple[object, ...]:
    """The values a Literal annotation allows, None among them for `Literal[...] | None`; ()
    for an open type."""
    if get_origin(kind) is Literal:
        return get_args(kind)
    if get_origin(kind) in (Union, UnionType):
        [part] = [part for part in get_args(kind) if part is not type(None)]
        return (*get_args(part), None) if get_origin(part) is Literal else ()
    return ()


OPTION_TYPES: dict[str, object] = get_type_hints(EngineOptions)
CHOICES = {name: choices(kind) for name, kind in OPTION_TYPES.items() if choices(kind)}
assert set(CHOICES["dtype"]) == {"auto", *DTYPES}
