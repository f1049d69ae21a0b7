"""bfloat16 weights on the CPU (kernels/bf16_linear.py, `dtype="bfloat16"` there and the
default on a CPU with AMX or AVX512-BF16): the linear against float matmul on
bfloat16-rounded inputs, how resolve_options.py picks it from the CPU's features, an engine on it
(generation, weight updates, sessions), and its quality on SmolLM2."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench
from engines import EngineFactory
from weight_kinds import (
    check_a_weight_update_rebuilds,
    check_sessions_equal_stateless,
    flips_against,
    prompts,
)

from shoal.config import EngineOptions
from shoal.kernels import cpu_features
from shoal.kernels.bf16_linear import (
    HEAD_CANDIDATES,
    Bf16Head,
    Bf16Linear,
    onednn_bf16_available,
)
from shoal.kernels.cpu_features import CpuFeatures, kernel_report
from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.linear import NEVER, make_linear
from shoal.models.load import load_model
from shoal.resolve_options import resolve

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_available(), reason="oneDNN has no bfloat16 matmul on this CPU"
)
XEON = CpuFeatures("Intel(R) Xeon(R) Processor", frozenset(cpu_features.FLAGS))
EPYC = CpuFeatures("AMD EPYC 7B13", frozenset({"avx2"}))
# AVX512-BF16 without AMX, as the AMD EPYC VM of bench/README.md reports it
EPYC_BF16 = CpuFeatures("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x w.T + b in float64 with x and w rounded to bfloat16 first, as the linear rounds them."""
    y = x.bfloat16().double() @ weight.bfloat16().double().T
    return (y if bias is None else y + bias.double()).float()


# ---- the linear ----------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 100), (8, 7), (3, 1536)])
@pytest.mark.parametrize("m", [1, 5, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_product_of_the_rounded_inputs(n: int, k: int, m: int, with_bias: bool) -> None:
    """Only the product is rounded further, to bfloat16 (8 bits): within 2^-8 of each value,
    plus float32's summation."""
    gen = torch.Generator().manual_seed(n * k + m)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    linear = make_linear("bf16", weight, bias)
    assert isinstance(linear, Bf16Linear)
    y, want = linear(x), reference(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    product = want if bias is None else want - bias
    torch.testing.assert_close(y, want, rtol=0, atol=float(product.abs().max()) * 2**-8 + 1e-5)


def test_shapes_and_a_new_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=gen)
    linear = Bf16Linear(weight, None)
    assert linear(torch.randn(2, 3, 16, generator=gen)).shape == (2, 3, 24)
    assert linear(torch.empty(0, 16)).shape == (0, 24)
    x = torch.randn(4, 16, generator=gen)
    other = torch.randn(24, 16, generator=gen)
    linear.load(other, None)
    y = linear(x)
    torch.testing.assert_close(y, reference(x, other, None), rtol=0.01, atol=0.05)
    assert not torch.allclose(y, reference(x, weight, None), atol=0.05)


def test_the_weight_is_not_the_callers() -> None:
    weight = torch.randn(8, 8)
    linear = Bf16Linear(weight, torch.zeros(8))
    before = linear(torch.ones(1, 8))
    weight.mul_(3)
    assert torch.equal(linear(torch.ones(1, 8)), before)


def test_the_heads_top_logits_are_float32s() -> None:
    """The lm_head's top candidates of each row are computed again from the float32 weight:
    exact to float32's rounding, so the greedy choice is float32's."""
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(500, 64, generator=gen), torch.randn(7, 64, generator=gen)
    head = make_linear("bf16", weight, None, head=True)
    assert isinstance(head, Bf16Head)
    y, exact = head(x), x.double() @ weight.double().T
    top = y.topk(HEAD_CANDIDATES, dim=-1).indices
    torch.testing.assert_close(y.gather(1, top).double(), exact.gather(1, top), rtol=0, atol=1e-4)
    assert torch.equal(y.argmax(-1), exact.argmax(-1))
    plain = Bf16Linear(weight, None)(x)  # the rest is the bfloat16 product's
    rest = torch.ones_like(y, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(y[rest], plain[rest])
    assert head(torch.empty(0, 64)).shape == (0, 500)


# ---- picked from the CPU's features --------------------------------------------------------


def fake_cpu(monkeypatch: pytest.MonkeyPatch, cpu: CpuFeatures) -> None:
    """The CPU `cpu` as the engine reads it: its flags, and oneDNN's own check of the matrix
    units as its flags say (on a CPU with AVX512-BF16 and no AMX, oneDNN's bfloat16 matmul runs
    without tiles, so `needs_onednn_bf16` passes while the real check would say no AMX)."""
    monkeypatch.setattr("shoal.resolve_options.read_cpu_features", lambda: cpu)
    monkeypatch.setattr(cpu_features, "amx_bf16", lambda: cpu.amx_bf16)


@needs_onednn_bf16
def test_auto_takes_bf16_weights_on_a_cpu_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, XEON)
    resolved = resolve(EngineOptions(device="cpu"), model_context=2048)
    assert resolved.linear_kind == "bf16"
    assert resolved.dtype == torch.float32  # the activations stay float32
    assert resolved.kv_dtype == torch.bfloat16  # the KV as the weights (kv_cache_dtype auto)
    float32 = resolve(EngineOptions(device="cpu", dtype="float32"), 2048)
    assert (float32.linear_kind, float32.kv_dtype) == ("packed", torch.float32)
    # int8 asked for: its own weights, float32 around them, the KV in bfloat16 as here by
    # default (bench/quality.py: 99.89% top-1 agreement with float32), float32 when asked
    int8 = resolve(EngineOptions(device="cpu", quantization="int8"), 2048)
    assert (int8.linear_kind, int8.dtype, int8.kv_dtype) == ("int8", torch.float32, torch.bfloat16)
    exact = resolve(
        EngineOptions(device="cpu", quantization="int8", kv_cache_dtype="float32"), 2048
    )
    assert exact.kv_dtype == torch.float32


@needs_onednn_bf16
def test_auto_takes_bf16_weights_on_avx512_bf16_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bfloat16 dot products without the tiles: offline 1.27-1.46x float32 on the
    AMD EPYC of bench/README.md, so the default there too."""
    fake_cpu(monkeypatch, EPYC_BF16)
    resolved = resolve(EngineOptions(device="cpu"), model_context=2048)
    assert (resolved.linear_kind, resolved.kv_dtype) == ("bf16", torch.bfloat16)
    int8 = resolve(EngineOptions(device="cpu", quantization="int8"), 2048)
    assert (int8.linear_kind, int8.kv_dtype) == ("int8", torch.bfloat16)


def test_auto_stays_float32_without_bf16_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, EPYC)
    resolved = resolve(EngineOptions(device="cpu"), model_context=2048)
    assert (resolved.linear_kind, resolved.dtype) == ("packed", torch.float32)
    int8 = resolve(EngineOptions(device="cpu", quantization="int8"), 2048)  # nor int8's KV
    assert (int8.linear_kind, int8.kv_dtype) == ("int8", torch.float32)
    no_amx = CpuFeatures("Intel(R) Xeon(R) Gold 6248", frozenset({"avx2", "avx512f"}))
    fake_cpu(monkeypatch, no_amx)
    assert resolve(EngineOptions(device="cpu"), model_context=2048).linear_kind == "packed"
    # the flag without oneDNN's bfloat16 kernel (a torch built without it)
    fake_cpu(monkeypatch, EPYC_BF16)
    monkeypatch.setattr(cpu_features, "onednn_bf16_available", lambda: False)
    assert resolve(EngineOptions(device="cpu"), model_context=2048).linear_kind == "packed"


def test_bfloat16_asked_for_on_the_cpu_is_the_weights_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cpu(monkeypatch, EPYC)
    resolved = resolve(EngineOptions(device="cpu", dtype="bfloat16"), model_context=2048)
    assert (resolved.linear_kind, resolved.dtype) == ("bf16", torch.float32)


def test_the_report_names_the_cpu_and_the_kernels(kernels: CpuKernels) -> None:
    cpu = torch.device("cpu")
    line = kernel_report(cpu, "bf16", "cpu", XEON)
    # AVX512-BF16 without AMX: the compiled panels (bf16_panels.cpp), loaded here
    assert "linear=bf16:panels-avx512bf16 " in kernel_report(cpu, "bf16", "cpu", EPYC_BF16)
    assert line.startswith('cpu="Intel(R) Xeon(R) Processor" isa=avx2+avx512f+avx512_vnni+')
    assert "amx_bf16" in line and "attention=cpu:" in line
    assert "linear=bf16:onednn-amx" in line or not onednn_bf16_available()
    assert "linear=packed:" in kernel_report(cpu, "packed", "torch", EPYC)
    assert "isa=avx2 " in kernel_report(cpu, "int8", "cpu", EPYC)
    int8 = kernel_report(cpu, "int8", "cpu", XEON)  # its many-row steps (int8_rows.py)
    assert "+onednn-amx@10 " in int8 or not onednn_bf16_available()
    # the KV's dtype, and where a bfloat16 one's decode attention runs on the tiles
    bf16 = torch.bfloat16
    assert kernel_report(cpu, "bf16", "cpu", XEON, kv_dtype=bf16).endswith(" kv=bfloat16:amx-tiles")
    assert kernel_report(cpu, "bf16", "cpu", EPYC, kv_dtype=bf16).endswith(" kv=bfloat16")
    assert kernel_report(cpu, "packed", "cpu", XEON, kv_dtype=torch.float32).endswith(" kv=float32")
    # float32's steps of many rows through oneDNN where the start measured it faster
    # (f32_many_rows.py); the panels alone where it did not, or before it measured
    packed = kernel_report(cpu, "packed", "cpu", EPYC, f32_many_rows=128)
    assert re.search(r" linear=packed:panels-\w+\+onednn@128 ", packed)
    for measured in (None, NEVER):
        said = kernel_report(cpu, "packed", "cpu", EPYC, f32_many_rows=measured)
        assert "+onednn" not in said and " linear=packed:panels-" in said


def test_features_are_read_from_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma bmi2\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma bmi2\n"
    )
    read = cpu_features.read_cpu_features(info)
    assert read == CpuFeatures("AMD EPYC 7B13", frozenset({"avx2"}))
    assert read.name() == "AMD EPYC 7B13"
    # a VM's bare model name: the family and model numbers tell a Zen 4 from a Zen 5
    info.write_text(
        "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
        "flags\t\t: avx2 avx512f\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n"
    )
    zen5 = cpu_features.read_cpu_features(info)
    assert zen5.generation == "family 26, model 2"
    assert zen5.name() == "AMD EPYC (family 26, model 2)"
    assert kernel_report(torch.device("cpu"), "packed", "cpu", zen5).startswith(
        'cpu="AMD EPYC (family 26, model 2)" isa=avx2+avx512f '
    )
    assert cpu_features.read_cpu_features(tmp_path / "absent").isa() == "none"
    # features the OS has not enabled (torch's checks) are not reported
    info.write_text("model name\t: Xeon\nflags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_features.read_cpu_features(info).flags == {"avx2", "avx512f"}


# ---- an engine on it -----------------------------------------------------------------------


async def test_a_bf16_engine_follows_the_float_engine(make_engine: EngineFactory) -> None:
    """bfloat16 picks float32's tokens until a near-tie, where it may pick the runner-up."""
    batch = prompts(8, 0)
    bf16 = await make_engine(dtype="bfloat16", page_size=4)
    assert bf16.resolved.linear_kind == "bf16"
    float32 = await make_engine(page_size=4)
    assert await flips_against(bf16, float32, batch) <= len(batch) // 2


async def test_a_weight_update_repacks(
    make_engine: EngineFactory, other_folder: Path, tiny_folder: Path
) -> None:
    await check_a_weight_update_rebuilds(make_engine, other_folder, tiny_folder, dtype="bfloat16")


async def test_sessions_on_bf16_equal_stateless_requests(make_engine: EngineFactory) -> None:
    await check_sessions_equal_stateless(make_engine, dtype="bfloat16")


# ---- quality on the real model --------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """As test_int8.py's: one OpenMP thread on a busy two-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The whole text measured 99.37%, 99.00%, 99.19% and 99.26% at chunks of 8, 16, 64 and 512 rows
# with the bfloat16 KV of kv_cache_dtype auto (99.23%, 99.34%, 98.97%, 99.30% with a float32
# KV; bench/README.md). The bound here leaves the first 1,024 tokens' noise below issue 32's
# 99%; without the head's float32 top logits (Bf16Head) it was 97.79%.
MIN_BF16_AGREEMENT = 0.985


@pytest.mark.slow
@needs_onednn_bf16
@pytest.mark.parametrize("chunk", [8, 64])  # a few decodes' rows, and a prompt chunk's
def test_smollm2_bf16_quality(
    monkeypatch: pytest.MonkeyPatch, one_thread: None, chunk: int
) -> None:
    """bench/quality.py on the text's first 1,024 tokens: top-1 agreement with float32 >= 98.5%
    and perplexity within 1% (issue 32's perplexity bound)."""
    quality = load_bench("quality", monkeypatch)
    loaded = load_model(None, progress=False)
    ids = quality.text_ids(loaded, 1024)
    line = quality.compare(loaded, "bf16", "packed", ids, window=1024, chunk=chunk)
    assert line["predictions"] == 1023
    assert line["top1_agreement"] >= MIN_BF16_AGREEMENT, line
    assert abs(line["ppl_ratio"] - 1) <= 0.01, line
