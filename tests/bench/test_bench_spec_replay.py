"""bench/spec_replay.py: answers replayed through the drafting policy. An answer that copies
its prompt is drafted and kept (a speedup past 2, under the oracle's); one with nothing to
copy sends no draft (exactly one token a step); saved answers replay to its fixed format."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from bench_scripts import fields, load_bench

from shoal.actors.scheduler.speculation import SpecConfig


def test_a_copied_answer_is_drafted_and_a_fresh_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("spec_replay", monkeypatch)
    rng = random.Random(0)
    passage = [rng.randrange(100, 5000) for _ in range(120)]
    prompt = [1, 2, 3, *passage, 4, 5]
    copied = bench.replay(prompt, passage, 0.15, 0.05, SpecConfig())
    assert copied.kept > 100 and copied.verifications < 30
    speedup = len(passage) / copied.steps
    oracle = len(passage) / bench.oracle(prompt, passage, 0.15, SpecConfig())
    assert 2.0 < speedup <= oracle
    fresh = [rng.randrange(5000, 9000) for _ in range(60)]  # no token of it occurred before
    alone = bench.replay(prompt, fresh, 0.15, 0.05, SpecConfig())
    assert alone.drafted == 0 and alone.steps == len(fresh)
    assert set(alone.trace.split()) == {"."}


def replayed(
    answers: list[dict[str, object]],
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> list[dict[str, str]]:
    """The script run on these answers (saved as --save writes them): its lines' fields."""
    bench = load_bench("spec_replay", monkeypatch)
    saved = tmp_path / "answers.json"
    saved.write_text(json.dumps(answers))
    asyncio.run(bench.main(bench.parse(["--answers", str(saved), *argv])))
    return [fields(line) for line in capsys.readouterr().out.splitlines()]


def test_saved_answers_replay_in_its_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    passage = list(range(10, 60))
    answers: list[dict[str, object]] = [
        {"mode": "float32", "workload": "copy", "index": 0, "prompt": [1, *passage]},
        {"mode": "float32", "workload": "prose", "index": 0, "prompt": [1, 2]},
    ]
    answers[0]["output"], answers[1]["output"] = passage, [7, 8, 9]
    argv = ["--draft-cost", "0.15", "0.3", "--trace"]
    lines = replayed(answers, argv, tmp_path, monkeypatch, capsys)
    assert [(f["workload"], f["draft_cost"]) for f in lines] == [
        ("copy", "0.15"), ("copy", "0.3"), ("prose", "0.15"), ("prose", "0.3")
    ]  # fmt: skip
    copy = lines[0]
    assert float(copy["speedup"]) > 2 and float(copy["oracle"]) >= float(copy["speedup"])
    assert int(copy["tokens"]) == 50 and int(copy["kept"]) > 0
    assert float(lines[1]["speedup"]) < float(copy["speedup"])  # dearer drafts pay less
    assert lines[2]["speedup"] == "1.000" and lines[2]["trace"] == ".,.,."


def test_the_most_drafts_a_verification_sends_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    passage = list(range(10, 70))
    answer = {"mode": "float32", "workload": "copy", "index": 0, "prompt": [1, *passage]}
    argv = ["--num-draft-tokens", "2", "8", "--trace"]
    short, long = replayed([{**answer, "output": passage}], argv, tmp_path, monkeypatch, capsys)
    assert (short["num_draft_tokens"], long["num_draft_tokens"]) == ("2", "8")
    assert max(int(v.split("/")[0]) for v in short["trace"].split(",") if v != ".") == 2
    assert max(int(v.split("/")[0]) for v in long["trace"].split(",") if v != ".") == 8
    assert int(short["verifications"]) > int(long["verifications"])
    assert float(short["speedup"]) < float(long["speedup"])
