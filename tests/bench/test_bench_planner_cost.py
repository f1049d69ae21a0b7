"""bench/planner_cost.py runs (`--smoke`: batches 1 and 32, 50 steps) and prints its fixed
format: a positive cost a step, a decode set for 32 requests and none for 1 with the columns
on, none at all with them off."""

from __future__ import annotations

import pytest
from bench_scripts import fields, load_bench

from shoal.actors.scheduler import decode_set


@pytest.mark.parametrize("columns", ["on", "off"])
def test_planner_cost_smoke(
    columns: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(decode_set, "MIN_MEMBERS", decode_set.MIN_MEMBERS)  # restored after
    bench = load_bench("planner_cost", monkeypatch)
    assert bench.main(["--smoke", "--columns", columns]) == 0
    lines = [fields(line) for line in capsys.readouterr().out.splitlines()]
    assert [(int(x["batch"]), x["decode_set"]) for x in lines] == [
        (1, "none"),
        (32, "built" if columns == "on" else "none"),
    ]
    for line in lines:
        assert line["columns"] == columns and int(line["steps"]) == 50
        assert float(line["us_per_step"]) > 0 and float(line["us_per_seq"]) > 0
