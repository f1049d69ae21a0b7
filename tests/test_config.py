"""Engine options resolve once at start: device, dtype, attention backend and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from shoal.config import CHOICES, EngineOptions, resolve


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
def test_auto_on_a_machine_without_cuda() -> None:
    resolved = resolve(EngineOptions(), model_context=8192)
    assert resolved.device == torch.device("cpu") and resolved.dtype == torch.float32
    assert resolved.attention == "cpu" and resolved.cuda_graph_max_batch == 0  # the C++ kernel
    bf16 = resolve(EngineOptions(dtype="bfloat16"), model_context=8192)
    assert bf16.attention == "torch"  # the kernel is float32 only
    with pytest.raises(ValueError, match="float32 only"):
        resolve(EngineOptions(dtype="bfloat16", attention="cpu"), model_context=8192)
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
