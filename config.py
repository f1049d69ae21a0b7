"""Engine configuration: the user's options, resolved once at start into narrow sections."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from types import UnionType
from typing import Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import torch

from shoal.disagg.peers import PrefillPeers
from shoal.kernels.cpu_features import bf16_by_default, read_cpu_features
from shoal.kernels.linear import LinearKind, packing_available
from shoal.limits import InputLimits
from shoal.memory import DeviceMemory, kv_cache_tokens

DEFAULT_LIMITS = InputLimits()
T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A CPU step's time grows with every prompt token it carries (about 1.1 ms each for SmolLM2 on
# the 2-core VM), so a cap keeps running streams steady; 64 halved 128's inter-token p99 at
# 16 streams for the same throughput (docs/cpu-step.md, "Scheduling for latency"). A GPU step
# barely notices a chunk, and no cap is what SGLang and vLLM do there.
CPU_MIXED_PREFILL_TOKENS = 64
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
        "prompt tokens a step that also decodes may take (unset: 64 on the CPU, no cap on a "
        "GPU; 0: up to max_batch_tokens); lower: steadier inter-token latency under load",
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
        "the KV cache's elements (auto: the weights' dtype, float32 with int8); on the CPU "
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
        8, "drafts one request verifies in a step at most (fewer while its drafts are refused)"
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


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    num_pages: int
    num_rows: int
    max_pages_per_row: int


@dataclass(frozen=True)
class Resolved:
    """Derived once at start; each actor gets only its own part."""

    cache: CacheLayout
    context_length: int
    dtype: torch.dtype  # the activations'
    device: torch.device
    attention: str  # "torch" | "triton" | "cpu"
    cuda_graph_max_batch: int  # 0 = no graphs (always 0 off CUDA or without Triton)
    linear_kind: LinearKind  # how the forward multiplies by weights (kernels/linear.py)
    mixed_prefill_tokens: int  # prompt tokens a step that also decodes may take; 0: no cap
    kv_dtype: torch.dtype  # the KV cache's elements


def resolve(
    options: EngineOptions,
    model_context: int,
    memory: DeviceMemory | None = None,
    has_experts: bool = False,
) -> Resolved:
    """`memory`: what sizes the KV pool when kv_cache_tokens is unset on CUDA (memory.py).
    `has_experts`: a mixture-of-experts model, whose routing picks on the host the experts a
    step runs (kernels/moe.py), so no graph can hold its decode; nor can one hold the forward
    split over pipeline stages."""
    options.validate()
    page_size = options.page_size
    num_pages = -(-kv_cache_tokens(options, model_context, memory) // page_size)
    context = min(options.context_length or model_context, model_context)
    # One request alone must always fit, or it could wait forever.
    context = min(context, (num_pages - 1) * page_size)
    if context < 2:
        raise ValueError("kv_cache_tokens is too small for even one request")
    device, weights_dtype = resolve_device(options)
    linear = resolve_linear(options, device, weights_dtype)
    # bfloat16 weights on the CPU: the activations stay float32 (bf16_linear.py)
    dtype = torch.float32 if linear == "bf16" else weights_dtype
    kv_dtype = resolve_kv_dtype(options, device, weights_dtype)
    attention = resolve_attention(options, device, dtype)
    graphs = 0
    one_forward = not has_experts and options.pipeline_stages == 1
    if device.type == "cuda" and attention == "triton" and one_forward:
        entries = options.max_running_requests  # a decode batch's, one a row ...
        if options.speculative_algorithm is not None:  # ... or one a draft's position
            drafting = min(options.speculative_max_running, options.max_running_requests)
            entries = max(entries, drafting * (1 + options.speculative_num_draft_tokens))
        graphs = min(options.cuda_graph_max_batch, entries)
    max_pages_per_row = -(-context // page_size) + 1
    layout = CacheLayout(page_size, num_pages, options.max_running_requests, max_pages_per_row)
    mixed = options.max_mixed_prefill_tokens
    if mixed is None:
        mixed = CPU_MIXED_PREFILL_TOKENS if device.type == "cpu" else 0
    return Resolved(layout, context, dtype, device, attention, graphs, linear, mixed, kv_dtype)


def resolve_kv_dtype(
    options: EngineOptions, device: torch.device, weights_dtype: torch.dtype
) -> torch.dtype:
    """auto: the weights' dtype (int8's: float32). The CPU's kernels read either float32 or
    bfloat16 (widened as they read); CUDA's Triton kernels and graphs keep the model's."""
    if options.kv_cache_dtype == "auto":
        return weights_dtype
    asked = DTYPES[options.kv_cache_dtype]
    if device.type == "cuda" and asked != weights_dtype:
        raise ValueError(
            f"kv_cache_dtype {options.kv_cache_dtype} on CUDA must be the weights' dtype "
            f"({str(weights_dtype).removeprefix('torch.')}): give auto"
        )
    return asked


def resolve_linear(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> LinearKind:
    """int8 when asked for (CPU only); else bfloat16 weights on the CPU when its dtype is
    bfloat16; packed float32 on the CPU; else dense."""
    if options.quantization == "int8":
        if device.type != "cpu":
            raise ValueError("quantization int8 runs on the CPU only")
        return "int8"
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "bf16"
    return "packed" if packing_available(device, dtype) else "dense"


def resolve_device(options: EngineOptions) -> tuple[torch.device, torch.dtype]:
    """The device (auto: CUDA when available) and the weights' dtype (auto: bf16 on CUDA and
    on a CPU with AMX or AVX512-BF16)."""
    name = options.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if name == "cuda" or cpu_takes_bf16(options) else "float32"
    return torch.device(name), DTYPES[dtype_name]


def cpu_takes_bf16(options: EngineOptions) -> bool:
    """dtype auto on the CPU: bfloat16 weights where the CPU has the matrix units for them
    (kernels/cpu_features.py), unless int8 was asked for (its own weights, float32 around)."""
    return options.quantization is None and bf16_by_default(read_cpu_features())


def resolve_attention(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> str:
    """auto: the Triton kernels on CUDA (when triton is installed; torch's CUDA wheels bring
    it); on the CPU in float32 the compiled kernels ("cpu", kernels/cpu_kernels.py;
    built on first use, and the torch reference if it cannot be built); else the torch
    reference. Triton on CPU runs only under its interpreter (TRITON_INTERPRET=1: correct and
    slow, for tests)."""
    has_triton = importlib.util.find_spec("triton") is not None
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    choice = options.attention
    if choice == "auto":
        if device.type == "cuda" and has_triton:
            choice = "triton"
        else:
            choice = "cpu" if cpu_float32 else "torch"
    if choice == "cpu" and not cpu_float32:
        raise ValueError("attention cpu runs on the CPU in float32 only")
    if choice == "triton":
        if not has_triton:
            raise ValueError("attention triton needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention triton on CPU runs only under the interpreter: set TRITON_INTERPRET=1"
            )
    return choice
