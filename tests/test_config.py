"""Engine options resolve once at start: device, dtype, attention backend and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from shoal.config import CHOICES, EngineOptions
from shoal.kernels.cpu_features import CpuFeatures
from shoal.resolve_options import CPU_MIXED_PREFILL_TOKENS, measured_mixed_prefill, resolve


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"cuda_graph_max_batch": -1}, "cuda_graph_max_batch"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"attention": "flash"}, "attention"),
        ({"max_stop_strings": 0}, "max_stop_strings"),
        ({"max_prompt_chars": -1}, "max_prompt_chars"),
        ({"max_sessions": -1}, "max_sessions"),  # 0 is allowed: no session opens
        ({"max_sessions_per_client": 0}, "max_sessions_per_client"),
        ({"max_session_timeout_s": 0.0}, "max_session_timeout_s"),
        ({"max_session_timeout_s": float("nan")}, "max_session_timeout_s"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineOptions(**options).validate()  # type: ignore[arg-type]


def test_a_closed_set_is_its_fields_literal() -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda, got 'tpu'"):
        EngineOptions(device="tpu").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantization must be int8 or unset, got 'int4'"):
        EngineOptions(quantization="int4").validate()  # type: ignore[arg-type]
    for value in CHOICES["attention"]:
        EngineOptions(attention=value).validate()  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the resolution without CUDA")
def test_auto_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU without AMX (auto on one with it: tests/kernels/test_bf16.py)
    epyc = CpuFeatures("AMD EPYC 7B13", frozenset({"avx2"}))
    monkeypatch.setattr("shoal.resolve_options.read_cpu_features", lambda: epyc)
    resolved = resolve(EngineOptions(), model_context=8192)
    assert resolved.device == torch.device("cpu") and resolved.dtype == torch.float32
    assert resolved.attention == "cpu" and resolved.cuda_graph_max_batch == 0  # the C++ kernel
    # bfloat16 on the CPU is the weights': the activations and the kernels stay float32's
    bf16 = resolve(EngineOptions(dtype="bfloat16"), model_context=8192)
    assert (bf16.linear_kind, bf16.dtype, bf16.attention) == ("bf16", torch.float32, "cpu")
    half = resolve(EngineOptions(dtype="float16"), model_context=8192)
    assert half.attention == "torch"  # the kernel is float32 only
    with pytest.raises(ValueError, match="float32 only"):
        resolve(EngineOptions(dtype="float16", attention="cpu"), model_context=8192)
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve(EngineOptions(device="cuda"), model_context=8192)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="the triton package is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    resolved = resolve(EngineOptions(device="cpu", attention="triton"), model_context=8192)
    assert resolved.attention == "triton" and resolved.cuda_graph_max_batch == 0  # no graphs
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve(EngineOptions(device="cpu", attention="triton"), model_context=8192)


def test_the_mixed_prefill_cap_is_64_on_the_cpu_and_none_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset: a CPU step carries at most 64 prompt tokens beside decodes until the start
    measures the model (test_the_start_measures_the_cap_when_unset), a GPU step any number
    (0); a value given is taken as it is, on either."""
    cpu = resolve(EngineOptions(device="cpu"), model_context=8192)
    assert cpu.mixed_prefill_tokens == CPU_MIXED_PREFILL_TOKENS == 64 and cpu.cap_to_measure
    measured = cpu.with_measured_cap(0.3)  # the start's replacement: nothing left to measure
    assert (measured.mixed_prefill_tokens, measured.cap_to_measure) == (128, False)
    for given in (0, 200):
        options = EngineOptions(device="cpu", max_mixed_prefill_tokens=given)
        kept = resolve(options, model_context=8192)
        assert kept.mixed_prefill_tokens == given and not kept.cap_to_measure
    monkeypatch.setattr(
        "shoal.resolve_options.resolve_device", lambda _: (torch.device("cuda"), torch.bfloat16)
    )
    monkeypatch.setattr("shoal.resolve_options.resolve_attention", lambda *_: "torch")
    gpu = resolve(EngineOptions(kv_cache_tokens=4096), model_context=8192)
    assert gpu.mixed_prefill_tokens == 0 and not gpu.cap_to_measure
    options = EngineOptions(kv_cache_tokens=4096, max_mixed_prefill_tokens=128)
    assert resolve(options, model_context=8192).mixed_prefill_tokens == 128
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens must be >= 0"):
        EngineOptions(max_mixed_prefill_tokens=-1).validate()


@pytest.mark.parametrize(
    ("ms", "cap"),
    [
        (1.1, 64),  # the AVX2 EPYC in float32: never below 64
        (0.47, 64),  # the Zen 5 in float32: 85 tokens fit in 40 ms
        (0.30, 128),  # the Zen 5 in bfloat16: 133
        (0.25, 160),  # 160 exactly
        (0.2, 192),
        (0.1, 256),  # never above 256
        (0.0, 256),
    ],
)
def test_the_measured_cap_is_the_tokens_that_fit_in_40_ms_in_steps_of_32(
    ms: float, cap: int
) -> None:
    assert measured_mixed_prefill(ms) == cap


def test_the_measured_cap_never_grows_with_the_cost() -> None:
    caps = [measured_mixed_prefill(ms / 100) for ms in range(1, 200)]
    assert caps == sorted(caps, reverse=True)
    assert {cap % 32 for cap in caps} == {0}
