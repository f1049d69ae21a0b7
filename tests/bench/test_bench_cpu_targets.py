"""bench/cpu_targets.py: the steps it would run, the targets it reads from their lines (met,
missed, not run), and a step's output read back from a real subprocess. The benchmarks it runs
have their own tests; their figures mean something only from a full sitting."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import fields, load_bench

CPU = "AMD_EPYC_family_26_model_2-avx2+avx512f+avx512_vnni+avx512_bf16-x86_64-2cpu"


def _offline(step: str, system: str, rate: float) -> dict[str, str]:
    rec = {"step": step, "kind": "offline", "system": system, "tok_per_s": str(rate)}
    return {**rec, "setup": f"{system}-kernels", "machine": CPU}


def _serving(step: str, system: str, c: int, *figures: float) -> dict[str, str]:
    """figures: output tok/s, TTFT and ITL medians (ms)"""
    rec = {"step": step, "kind": "serving", "system": system, "mode": "concurrency"}
    keys = ("out_tok_per_s", "ttft_ms_median", "itl_ms_median")
    return {**rec, "load": str(c), **{k: str(x) for k, x in zip(keys, figures, strict=True)}}


def _quality(kind: str, top1: float, ppl: float) -> dict[str, str]:
    rec = {"step": f"quality_{kind}", "kind": "quality"}
    return {**rec, "top1_agreement": str(top1), "ppl_ratio": str(ppl)}


SITTING = [
    _offline("offline_default", "shoal", 910.0),
    _offline("offline_default", "vllm", 700.0),  # 1.3x: met
    _offline("offline_float32", "shoal", 500.0),
    _offline("offline_float32", "vllm", 400.0),  # 1.25x: missed
    _offline("offline_int8", "shoal", 1060.0),
    _offline("offline_float32_after", "shoal", 560.0),  # against the mean, 530: 2.0x met
    _serving("serving_default", "shoal", 1, 60.0, 50.0, 7.0),
    _serving("serving_default", "vllm-bfloat16", 1, 40.0, 60.0, 12.0),
    _serving("serving_default", "shoal", 16, 600.0, 140.0, 15.0),
    _serving("serving_default", "vllm-bfloat16", 16, 410.0, 130.0, 24.0),  # TTFT higher: missed
    _serving("serving_float32", "shoal_--dtype_float32", 1, 50.0, 60.0, 11.5),
    _serving("serving_float32", "vllm", 1, 30.0, 60.0, 19.0),
    _serving("serving_float32", "shoal_--dtype_float32", 16, 390.0, 220.0, 22.0),
    _serving("serving_float32", "vllm", 16, 290.0, 190.0, 31.0),
    _serving("one_stream_int8", "shoal-int8", 1, 200.0, 40.0, 3.6),
    _serving("one_stream_int8", "llamacpp", 1, 50.0, 40.0, 19.2),
    _quality("bf16", 0.989, 1.002),  # top-1 under 0.99: missed
    _quality("int8", 0.993, 0.999),
]

EXPECTED = {  # target: (ratio, verdict)
    "offline_default,_tok/s": ("1.3", "met"),
    "offline_float32,_tok/s": ("1.25", "missed"),
    "offline_int8_(VNNI/AMX_CPU),_tok/s": ("2", "met"),
    "serving_default_16_streams,_tok/s": ("1.463", "met"),
    "serving_default_16_streams,_TTFT_median_ms": ("1.077", "missed"),
    "serving_default_16_streams,_ITL_median_ms": ("0.625", "met"),
    "serving_float32_16_streams,_tok/s": ("1.345", "met"),
    "one_stream_float32,_ITL_median_ms": ("0.6053", "met"),
    "one_stream_int8,_ITL_median_ms": ("0.1875", "met"),
    "quality_bf16,_top-1_against_float32": ("-", "missed"),  # no ratio of top-1 to ppl
    "quality_int8,_top-1_against_float32": ("-", "met"),
}


def _targets(out: str) -> dict[str, dict[str, str]]:
    lines = [fields(x) for x in out.splitlines() if x.startswith("cpu_target ")]
    return {line["target"]: line for line in lines}


def test_every_target_is_read_from_its_steps_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_targets", monkeypatch)
    raw, out = tmp_path / "raw.jsonl", tmp_path / "targets.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in SITTING))
    assert bench.main(["--from", str(raw), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    got = _targets(printed)
    assert {k: (v["ratio"], v["verdict"]) for k, v in got.items()} == EXPECTED
    assert all(v["machine"] == CPU for v in got.values())  # the sitting's CPU, not this one's
    assert got["offline_int8_(VNNI/AMX_CPU),_tok/s"]["peer_value"] == "530"
    assert len(out.read_text().splitlines()) == len(EXPECTED)
    assert f"CPU: {CPU}" in printed and printed.count("\n| ") == len(EXPECTED) + 2  # head, rule
    assert "\n- offline_default shoal: shoal-kernels\n" in printed  # each setup named once
    assert printed.count("- offline_float32 vllm: vllm-kernels") == 1


def test_each_round_is_held_to_the_targets_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_targets", monkeypatch)
    second = [{**r, "round": "2"} for r in SITTING]
    second[1] = {**second[1], "tok_per_s": "800.0"}  # vLLM faster in round 2: 1.14x
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in [*SITTING, *second]))
    assert bench.main(["--from", str(raw)]) == 0
    printed = capsys.readouterr().out
    lines = [fields(x) for x in printed.splitlines() if x.startswith("cpu_target ")]
    assert [x["round"] for x in lines] == ["1"] * len(EXPECTED) + ["2"] * len(EXPECTED)
    default = [x for x in lines if x["target"] == "offline_default,_tok/s"]
    assert [(x["ratio"], x["verdict"]) for x in default] == [("1.3", "met"), ("1.137", "missed")]
    row = next(x for x in printed.splitlines() if x.startswith("| offline default"))
    assert row.endswith("| 910 / 700 (1.30x): met | 910 / 800 (1.14x): missed |")


def test_int8s_2x_is_not_asked_of_a_cpu_without_vnni_or_amx(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2-only CPU (the Zen 3 EPYC) has no integer dot-product units: int8 under 2x
    float32 there is not a miss; its figures are still shown. Every other target is as before."""
    bench = load_bench("cpu_targets", monkeypatch)
    avx2 = "AMD_EPYC_family_25_model_1-avx2-x86_64-2cpu"
    sitting = [{**r, "machine": avx2} if "machine" in r else r for r in SITTING]
    sitting[4] = {**sitting[4], "tok_per_s": "500.0"}  # int8 0.94x float32
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in sitting))
    assert bench.main(["--from", str(raw)]) == 0
    printed = capsys.readouterr().out
    got = _targets(printed)
    int8 = got["offline_int8_(VNNI/AMX_CPU),_tok/s"]
    assert (int8["shoal"], int8["ratio"], int8["verdict"]) == ("500", "0.9434", "not_this_CPU's")
    others = {k: (v["ratio"], v["verdict"]) for k, v in got.items() if v is not int8}
    assert others == {k: v for k, v in EXPECTED.items() if not k.startswith("offline_int8")}
    assert "500 / 530 (0.94x): not this CPU's |" in printed
    # on a CPU with VNNI the same figures miss
    sitting = [{**r, "machine": CPU} if "machine" in r else r for r in sitting]
    raw.write_text("".join(json.dumps(r) + "\n" for r in sitting))
    assert bench.main(["--from", str(raw)]) == 0
    assert _targets(capsys.readouterr().out)["offline_int8_(VNNI/AMX_CPU),_tok/s"]["verdict"] == (
        "missed"
    )


def test_a_step_not_run_leaves_its_targets_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_targets", monkeypatch)
    raw = tmp_path / "raw.jsonl"
    kept = [r for r in SITTING if r["step"] not in ("offline_float32", "serving_default")]
    raw.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert bench.main(["--from", str(raw)]) == 0
    got = _targets(capsys.readouterr().out)
    not_run = {k for k, v in got.items() if v["verdict"] == "not_run"}
    assert not_run == {
        "offline_float32,_tok/s",
        "serving_default_16_streams,_tok/s",
        "serving_default_16_streams,_TTFT_median_ms",
        "serving_default_16_streams,_ITL_median_ms",
    }
    # int8 is then held against the one float32 run there is
    assert got["offline_int8_(VNNI/AMX_CPU),_tok/s"]["peer_value"] == "560"


def test_dry_run_names_each_step_and_its_peers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_targets", monkeypatch)
    argv = ["--dry-run", "--vllm-python", "/v/py", "--llamacpp-python", "/l/py"]
    assert bench.main([*argv, "--vllm-dtype", "bfloat16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in lines] == [s.name for s in bench.steps(None, None, "float32")]
    by_name = dict(x.split(": ", 1) for x in lines)
    assert "--vllm-python /v/py" in by_name["offline_default"]
    assert "--vllm-dtype bfloat16" in by_name["serving_default"]
    assert "--shoal-args '--dtype float32'" in by_name["serving_float32"]
    assert "--llamacpp-python /l/py --quantization int8" in by_name["one_stream_int8"]
    assert bench.main(["--dry-run", "--steps", "quality_int8", "offline_int8"]) == 0
    assert [x.split(":")[0] for x in capsys.readouterr().out.splitlines()] == [
        "offline_int8",
        "quality_int8",
    ]
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--steps", "offline_fp8"])


def _with_fake_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> ModuleType:
    """cpu_targets with its bench folder a temporary one holding fake.py (`import sys`, then
    `body`), which its steps can name."""
    bench = load_bench("cpu_targets", monkeypatch)
    (tmp_path / "fake.py").write_text("import sys\n" + body)
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    return bench


def test_a_step_is_read_from_its_scripts_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real subprocess: its result lines are kept with their step's name, the rest echoed."""
    bench = _with_fake_script(
        tmp_path,
        monkeypatch,
        "print('loading...')\n"
        "print('offline system=shoal tok_per_s=12.5 args=' + ','.join(sys.argv[1:]))\n"
        "print('offline system=vllm skipped reason=no vLLM here')\n"
        "sys.exit(3)\n",
    )
    records = bench.run_step(bench.Step("offline_default", "fake.py", ("--x", "1")))
    assert records == [
        {
            "step": "offline_default",
            "kind": "offline",
            "system": "shoal",
            "tok_per_s": "12.5",
            "args": "--x,1",
        },
        {"step": "offline_default", "kind": "offline", "system": "vllm", "reason": "no"},
    ]
    err = capsys.readouterr().err
    assert "loading..." in err and "rc=3" in err  # echoed, and a failed step does not raise


def test_the_plan_runs_round_after_round_and_keeps_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    line = "print('quality top1_agreement=0.99 ppl_ratio=1.0 step_arg=' + sys.argv[1])\n"
    bench = _with_fake_script(tmp_path, monkeypatch, line)
    plan = [bench.Step(f"quality_{k}", "fake.py", (a,)) for k, a in (("bf16", "a"), ("int8", "b"))]
    raw = tmp_path / "raw.jsonl"
    records = bench.run_plan(plan, 2, 0.0, raw)
    assert [(r["round"], r["step"], r["step_arg"]) for r in records] == [
        ("1", "quality_bf16", "a"),
        ("1", "quality_int8", "b"),
        ("2", "quality_bf16", "a"),
        ("2", "quality_int8", "b"),
    ]
    assert [json.loads(x) for x in raw.read_text().splitlines()] == records
    capsys.readouterr()
    assert bench.main(["--from", str(raw)]) == 0  # the table from them: two rounds
    quality = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| quality")]
    assert len(quality) == 2 and all(x.count(": met") == 2 for x in quality)
