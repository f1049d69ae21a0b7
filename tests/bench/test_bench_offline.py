"""bench/offline.py and bench/prefix.py run (a few tiny requests) and print their fixed format;
bench/roofline.py's arithmetic matches hand-computed examples; the vLLM peer (a worker in
another environment) is tested against a fake `vllm` package, and skipped without one."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from bench_scripts import BENCH, fields, load_bench
from fake_vllm_package import fake_vllm

from shoal.kernels.cpu_kernels import build_isa
from shoal.kernels.linear import packing_available

# the C++ decode kernel on a machine that can build it (kernels/cpu_attention.py), else torch's
ATTENTION = "cpu" if shutil.which("c++") else "torch"
# float32's linears as the setup names them (kernels/cpu_features.kernel_choice): the panels
# of this CPU's build with the compiled kernels, else oneDNN's matmul
PACKED = f"packed:panels-{build_isa()}" if ATTENTION == "cpu" else "packed:onednn"
LINEAR = PACKED if packing_available(torch.device("cpu"), torch.float32) else "dense:torch"
# The runs ask for float32: shoal's auto takes bfloat16 weights on a CPU with AMX.
FLOAT32 = ["--dtype", "float32"]


def test_offline_benchmark_smoke(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench("offline", monkeypatch)
    out = tmp_path / "offline.jsonl"
    argv = ["--model", str(tiny_folder), "--smoke", "--peers", "hf", "--out", str(out), *FLOAT32]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [fields(line) for line in lines if line.startswith("offline system=")]
    assert [r["system"] for r in runs] == ["shoal", "hf-generate-batch2", "hf-generate-solo"]
    shoal, batch, solo = runs
    assert shoal["output_tokens"] == batch["output_tokens"]  # ignore_eos: every token asked for
    assert int(solo["requests"]) == 1 and all(float(r["tok_per_s"]) > 0 for r in runs)
    summary = fields(next(line for line in lines if line.startswith("offline summary")))
    assert float(summary["shoal_over_hf_batch"]) > 0 and float(summary["shoal_over_hf_solo"]) > 0
    assert "shoal_over_vllm" not in summary
    assert len(out.read_text().splitlines()) == 3
    assert shoal["setup"] == f"cpu-float32-{ATTENTION}-graphs0-inflight2-{LINEAR}"
    assert batch["setup"] == solo["setup"] == "cpu-float32-hf"
    assert all(float(r["setup_s"]) >= 0 for r in runs)


@pytest.mark.parametrize("family", ["mixtral", "mistral"])
def test_offline_runs_a_tiny_family_and_counts_window_pages(
    family: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model tiny:<family>`: a tiny MoE and a tiny windowed model run; the page line shows
    a windowed generation holding pages for its window (16 tokens), not its length."""
    bench = load_bench("offline", monkeypatch)
    argv = ["--model", f"tiny:{family}", "--smoke", "--peers", "--window-pages", "300"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    (run,) = [fields(line) for line in lines if line.startswith("offline system=")]
    assert run["system"] == "shoal" and int(run["output_tokens"]) > 0
    (pages,) = [fields(line) for line in lines if line.startswith("pages ")]
    assert int(pages["tokens"]) == 308 and int(pages["pages_for_length"]) == 20
    if family == "mistral":  # window 16, pages of 16: the window spans at most two pages
        assert pages["window"] == "16" and int(pages["held_peak"]) <= 3
        assert int(pages["trimmed"]) >= 17
    else:
        # sampled every 5 ms, so the last pages may fall between samples
        assert pages["window"] == "none" and 12 <= int(pages["held_peak"]) <= 20


DECODE_KEYS = [
    "batch",
    "prompt_tokens",
    "output_tokens",
    "steps",
    "context_tokens",
    "step_ms",
    "roofline_ms",
    "fraction_of_roofline",
    "hbm_gbps",
    "weight_mb",
    "kv_mb",
    "setup",
    "machine",
]


def test_offline_decode_steps_smoke(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench("offline", monkeypatch)
    out = tmp_path / "decode.jsonl"
    small = ["--model", str(tiny_folder), "--requests", "0", "--decode-batch", "1", "2"]
    small += [*FLOAT32, "--decode-prompt-len", "8", "--decode-output-len", "6", "--out", str(out)]
    assert bench.main([*small, "--hbm-gbps", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["decode", "decode"]  # --requests 0: no others
    runs = [fields(line) for line in lines]
    assert all(list(r) == DECODE_KEYS for r in runs)
    assert [r["batch"] for r in runs] == ["1", "2"]
    for r in runs:
        assert 1 <= int(r["steps"]) <= 5 and float(r["step_ms"]) > 0
        assert r["hbm_gbps"] == "100.0"
        assert r["setup"] == f"cpu-float32-{ATTENTION}-graphs0-inflight2-{LINEAR}"
        mb = float(r["weight_mb"]) + float(r["kv_mb"])
        assert float(r["roofline_ms"]) == pytest.approx(mb * 1e6 / 100e9 * 1e3, abs=1e-4)
        fraction = float(r["roofline_ms"]) / float(r["step_ms"])
        assert float(r["fraction_of_roofline"]) == pytest.approx(fraction, abs=2e-3)
    assert len(out.read_text().splitlines()) == 2

    assert bench.main([*small[:6], *FLOAT32, "--no-overlap"]) == 0  # CPU, no --hbm-gbps: unknown
    r = fields(capsys.readouterr().out.splitlines()[0])
    assert r["roofline_ms"] == r["fraction_of_roofline"] == r["hbm_gbps"] == "unknown"
    assert r["setup"] == f"cpu-float32-{ATTENTION}-graphs0-inflight1-{LINEAR}"
    assert float(r["step_ms"]) > 0


def test_offline_decode_flags_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("offline", monkeypatch)
    with pytest.raises(SystemExit):  # more sequences than the engine runs at once
        bench.parse_args(["--decode-batch", "256"])
    with pytest.raises(SystemExit):  # 256 x (32 + 64) tokens do not fit 16384
        bench.parse_args(
            ["--decode-batch", "256", "--max-running", "256", "--kv-cache-tokens", "16384"]
        )
    args = bench.parse_args(["--decode-batch", "1", "64", "256", "--max-running", "256"])
    assert args.decode_batch == [1, 64, 256] and args.device == "cpu"
    assert args.peers == ["vllm", "hf"] and args.quantization is None
    assert bench.parse_args(["--peers"]).peers == []  # shoal alone
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "sglang"])


# ---- the vLLM peer, against a fake vllm package ---------------------------------------------


def test_offline_measures_vllm_through_its_worker(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = fake_vllm(tmp_path, monkeypatch)
    bench = load_bench("offline", monkeypatch)
    out = tmp_path / "offline.jsonl"
    argv = ["--model", str(tiny_folder), "--smoke", "--peers", "vllm", "--out", str(out), *FLOAT32]
    assert bench.main([*argv, "--vllm-python", sys.executable]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [fields(line) for line in lines if line.startswith("offline system=")]
    assert [r["system"] for r in runs] == ["shoal", "vllm"]
    shoal, vllm = runs
    assert vllm["output_tokens"] == shoal["output_tokens"] and vllm["requests"] == "4"
    assert vllm["setup"] == "cpu-float32-vllm0.0fake" and float(vllm["setup_s"]) >= 0
    summary = fields(next(line for line in lines if line.startswith("offline summary")))
    assert list(summary) == ["shoal_over_vllm", "machine"]
    ratio = float(shoal["tok_per_s"]) / float(vllm["tok_per_s"])
    assert float(summary["shoal_over_vllm"]) == pytest.approx(ratio, rel=0.02)
    assert [json.loads(t)["system"] for t in out.read_text().splitlines()] == ["shoal", "vllm"]

    # What the worker asked of vLLM: the warm-up, then shoal's prompts, each exactly its length.
    seen = json.loads(record.read_text())
    assert seen["model"] == str(tiny_folder) and seen["dtype"] == "float32"
    assert seen["env_bind"] == f"0-{torch.get_num_threads() - 1}"
    assert str(BENCH) not in seen["sys_path"] and seen["cwd"] == tempfile.gettempdir()
    warm_up, timed = seen["calls"]
    assert [p for p, _ in warm_up] == [load_bench("bench_format", monkeypatch).WARM_UP_PROMPT]
    vocab = json.loads((tiny_folder / "config.json").read_text())["vocab_size"]
    work = bench.workload(4, vocab, 0, (4, 8), (2, 4))  # --smoke's, as shoal got them
    for (prompt, params), (ids, n) in zip(timed, work, strict=True):
        assert prompt == ids
        assert params == {"min_tokens": n, "max_tokens": n, "ignore_eos": True, "temperature": 0.0}
    assert sum(params["max_tokens"] for _, params in timed) == int(vllm["output_tokens"])


def test_offline_skips_vllm_it_cannot_run(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench("offline", monkeypatch)
    argv = ["--model", str(tiny_folder), "--smoke", "--peers", "vllm"]
    assert bench.main([*argv, "--vllm-python", str(tmp_path / "no-python")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("offline system=shoal ")
    assert lines[1].startswith("offline system=vllm skipped reason=")
    assert "no-python does not run" in lines[1] and "--vllm-python" in lines[1]
    assert len(lines) == 2  # no summary: nothing to compare with

    fake_vllm(tmp_path, monkeypatch)  # a vLLM that fails to start: skipped, its output on stderr
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    assert bench.main([*argv, "--vllm-python", sys.executable]) == 0
    captured = capsys.readouterr()
    skipped = captured.out.splitlines()[1]
    assert skipped.startswith("offline system=vllm skipped reason=the vLLM worker exited with 1")
    assert "fake vLLM refuses to start" in captured.err


def test_vllm_python_is_found_or_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    peer = load_bench("vllm_peer", monkeypatch)
    monkeypatch.delenv("SHOAL_BENCH_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    if importlib.util.find_spec("vllm") is None:  # shoal's environment has no vLLM
        python, reason = peer.find_python(None)
        assert python is None and "SHOAL_BENCH_VLLM_PYTHON" in reason
    python, reason = peer.find_python(sys.executable)  # a Python without vllm
    assert python is None and reason == f"{sys.executable} cannot import vllm (from --vllm-python)"
    fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("SHOAL_BENCH_VLLM_PYTHON", sys.executable)
    assert peer.find_python(None) == (sys.executable, "")
    assert peer.find_python(str(tmp_path / "none"))[0] is None  # the flag wins over the variable

    env = peer.vllm_env(4, sys.executable, {"HF_HUB_OFFLINE": "0"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["HF_HUB_OFFLINE"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and "LD_PRELOAD" not in env
    venv = tmp_path / "venv"  # an environment with Intel's OpenMP: preloaded, as vLLM asks
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()
    env = peer.vllm_env(2, str(venv / "bin" / "python"), {})
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")
    assert peer.vllm_env(2, str(venv / "bin" / "python"), {"LD_PRELOAD": ""})["LD_PRELOAD"] == ""

    line = 'vllm_offline_result {"tokens": 9, "seconds": 1.5, "setup_s": 120.0, "setup": "x"}'
    assert peer.parse_result(line) == peer.OfflineResult(9, 1.5, 120.0, "x")
    assert peer.parse_result("INFO engine ready") is None


SMOLLM2_135M = {  # its config.json, the fields the roofline reads
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


def test_roofline_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.models.load import model_config

    roofline = load_bench("roofline", monkeypatch)
    config = model_config(SMOLLM2_135M)
    # Per layer: q 576*576 + k,v 2*576*192 + o 576*576 + mlp 3*576*1536 + norms 2*576
    #   = 331776 + 221184 + 331776 + 2654208 + 1152 = 3540096; x 30 layers = 106202880;
    # + final norm 576 + lm_head 49152*576 = 28311552 -> 134515008 (SmolLM2-135M's parameter
    # count: lm_head is the tied embedding) + 1 embedding row 576 = 134515584 elements, bf16.
    # KV: 1 sequence x 96 tokens x 30 layers x 2 (K, V) x 3 heads x 64 = 1105920 elements.
    need = roofline.decode_step_bytes(config, 1, 96, 2)
    assert need.weights == 134515584 * 2 == 269031168
    assert need.kv_cache == 1105920 * 2 == 2211840
    # At an H100 SXM's 3350 GB/s: 271243008 bytes / 3.35e12 B/s = 80.968 us.
    assert roofline.roofline_s(need.total, 3350.0) == pytest.approx(80.968e-6, rel=1e-5)

    # 256 sequences: 255 more embedding rows, 256x the KV (96 tokens each).
    wide = roofline.decode_step_bytes(config, 256, 96, 2)
    assert wide.weights == need.weights + 255 * 576 * 2
    assert wide.kv_cache == 256 * need.kv_cache

    # Tiny, with q/k/v biases, float32: hidden 4, intermediate 6, 1 layer, 2 heads of 2, one
    # KV head, vocab 10. Per layer 16 + 16 + 16 + biases (4 + 2 + 2) + 72 + 8 = 136; + norm 4,
    # 3 embedding rows 12, lm_head 40 = 192 elements; KV 3 x 5 tokens x 1 x 2 x 1 x 2 = 60.
    tiny = {**SMOLLM2_135M, "model_type": "qwen2", "vocab_size": 10, "hidden_size": 4}
    tiny |= {"intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2}
    tiny |= {"num_key_value_heads": 1, "tie_word_embeddings": False}
    small = roofline.decode_step_bytes(model_config(tiny), 3, 5, 4)
    assert (small.weights, small.kv_cache) == (192 * 4, 60 * 4)
    assert roofline.roofline_s(small.total, 100.0) == pytest.approx(1008 / 100e9)


def test_hbm_bandwidth_by_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    roofline = load_bench("roofline", monkeypatch)
    assert roofline.hbm_gbps_for("NVIDIA H100 80GB HBM3") == 3350.0  # SXM
    assert roofline.hbm_gbps_for("NVIDIA H100 PCIe") == 2000.0
    assert roofline.hbm_gbps_for("NVIDIA H200") == 4800.0
    assert roofline.hbm_gbps_for("NVIDIA H100 NVL") is None  # not in the table: --hbm-gbps
    assert roofline.hbm_gbps_for("NVIDIA A100-SXM4-80GB") is None


def test_decode_window(monkeypatch: pytest.MonkeyPatch) -> None:
    roofline = load_bench("roofline", monkeypatch)
    # One step a second; request r gets its first token at second r, 6 tokens each.
    arrivals = [[float(r + i) for i in range(6)] for r in range(3)]
    window = roofline.decode_window(arrivals, prompt_tokens=10)
    # Request 2 starts last (t=2); request 0 finishes first (t=5): request 2's tokens 1..3
    # came from steps of all three, which read 10 + 1 .. 10 + 3 tokens of context.
    assert (window.steps, window.seconds, window.context_tokens) == (3, 3.0, 12.0)
    assert window.step_s == 1.0
    with pytest.raises(ValueError, match="whole batch"):  # request 0 ends before 2 starts
        roofline.decode_window([[0.0, 1.0], [5.0, 6.0]], prompt_tokens=10)


def test_prefix_benchmark_smoke(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("prefix", monkeypatch)
    assert bench.main(["--model", str(tiny_folder), "--smoke"]) == 0
    runs = [fields(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["cache"] for r in runs] == ["on", "off"]
    on, off = runs
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == "0"
    assert on["output_tokens"] == off["output_tokens"] == "8"  # 4 requests x 2 tokens

    assert bench.main(["--model", str(tiny_folder), "--smoke", "--warm"]) == 0
    on, off = [fields(line) for line in capsys.readouterr().out.splitlines()]
    assert on["warm"] == off["warm"] == "True" and off["cached_tokens"] == "0"
    assert int(on["cached_tokens"]) >= 4 * 16  # each request finds at least a page of its prefix
