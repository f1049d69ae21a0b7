"""bench/weight_updates.py runs on the tiny model (one run of each source) and prints its
fixed format: the three sources, the checkpoint's bytes, a positive rate."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import fields, load_bench


def test_weight_updates_smoke(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench("weight_updates", monkeypatch)
    assert bench.main(["--model", str(tiny_folder), "--runs", "1"]) == 0
    lines = [fields(line) for line in capsys.readouterr().out.splitlines()]
    lines = [line for line in lines if "source" in line]
    assert [line["source"] for line in lines] == ["disk", "tensor", "distributed"]
    size = sum(f.stat().st_size for f in tiny_folder.glob("*.safetensors"))
    for line in lines:
        assert 0 < int(line["bytes"]) <= size and int(line["runs"]) == 1
        assert float(line["gb_per_s"]) > 0
