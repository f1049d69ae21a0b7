"""bench/offline.py and bench/prefix.py run (a few tiny requests) and print their fixed format."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the benchmarks import their shared helpers
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)


def test_offline_benchmark_smoke(
    tiny_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_bench("offline", monkeypatch)
    out = tmp_path / "offline.jsonl"
    assert bench.main(["--model", str(tiny_folder), "--smoke", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [fields(line) for line in lines if line.startswith("offline system=")]
    assert [r["system"] for r in runs] == ["shoal", "hf-generate-batch2", "hf-generate-solo"]
    shoal, batch, solo = runs
    assert shoal["output_tokens"] == batch["output_tokens"]  # ignore_eos: every token asked for
    assert int(solo["requests"]) == 1 and all(float(r["tok_per_s"]) > 0 for r in runs)
    summary = fields(next(line for line in lines if line.startswith("offline summary")))
    assert float(summary["shoal_over_hf_batch"]) > 0 and float(summary["shoal_over_hf_solo"]) > 0
    assert len(out.read_text().splitlines()) == 3


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
