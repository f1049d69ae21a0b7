"""The benchmarks in bench/ as the tests run them: each script loaded as a module (its shared
helpers importable, as when it runs from bench/), and its fixed-format lines read back.

    bench = load_bench("offline", monkeypatch)
    assert bench.main(["--smoke", ...]) == 0
    runs = [fields(line) for line in capsys.readouterr().out.splitlines()]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the benchmarks import their shared helpers
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def fields(line: str) -> dict[str, str]:
    """A fixed-format line's `key=value` fields (after its first word)."""
    return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
