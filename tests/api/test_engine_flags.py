"""The engine's flags come from EngineOptions (api/engine_flags.py): every field is a flag of
every command that starts an engine, reaches the engine's options as given, keeps the declared
default when not given, and says its line; README's table lists every field with that line.
A new field is covered by these tests without touching them."""

from __future__ import annotations

import re
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

import pytest

from shoal.api.cli import build_parser, engine_from_args
from shoal.api.engine_flags import RENAMED, engine_options
from shoal.api.sampling_wire import sampling_from_args
from shoal.config import CHOICES, OPTION_TYPES, EngineOptions

README = Path(__file__).resolve().parents[2] / "README.md"
COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"]}  # argv that starts each
TABLE_HEAD = "| option | default | what it sets |"


def flag(command: str, name: str) -> str:
    return "--" + RENAMED.get(command, {}).get(name, name).replace("_", "-")


def asked(index: int, info: Field[Any]) -> Any:
    """A valid value other than the default, distinct per field (so two swapped flags show)."""
    kind, default = OPTION_TYPES[info.name], info.default
    if kind is bool:
        return not default
    if info.name in CHOICES:
        return [value for value in CHOICES[info.name] if value not in (default, None)][-1]
    if kind in (int, int | None):
        return (default or 0) + index + 1
    if kind == str | None:  # one entry per pipeline stage (fixed in `every_value`)
        return f"value-{index}"
    if kind is float:
        return default + index + 1
    if kind is str:  # a host:port (disaggregation_prefill_peers is validated as one)
        return f"host-{index}:{1000 + index}"
    raise AssertionError(f"teach this test a value of {info.name}'s type, {kind}")


def argv_for(command: str, values: dict[str, Any]) -> list[str]:
    argv = list(COMMANDS[command])
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag(command, name) if value else "--no-" + flag(command, name)[2:])
        else:
            argv += [flag(command, name), str(value)]
    return argv


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_that_reaches_the_engine(command: str) -> None:
    values = {info.name: asked(i, info) for i, info in enumerate(fields(EngineOptions))}
    stages = values["pipeline_stages"]
    values["stage_devices"] = ",".join(["cpu"] * stages)  # validated: one a stage
    values["stage_layers"] = ",".join(["1"] * stages)
    args = build_parser().parse_args(argv_for(command, values))
    assert engine_options(args) == EngineOptions(**values)
    assert engine_from_args(args).options == EngineOptions(**values)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flag_not_given_keeps_the_declared_default(command: str) -> None:
    args = build_parser().parse_args(COMMANDS[command])
    assert engine_options(args) == EngineOptions()
    one = build_parser().parse_args([*COMMANDS[command], "--max-sessions", "3"])
    assert engine_options(one) == EngineOptions(max_sessions=3)


def test_pp_is_pipeline_stages() -> None:
    args = build_parser().parse_args(["serve", "--pp", "2", "--stage-layers", "10,20"])
    assert engine_options(args) == EngineOptions(pipeline_stages=2, stage_layers="10,20")


def test_seed_is_the_engines_on_serve_and_the_requests_on_generate() -> None:
    parser = build_parser()
    assert engine_options(parser.parse_args(["serve", "--seed", "5"])).seed == 5
    args = parser.parse_args(["generate", "hi", "--seed", "5", "--engine-seed", "3"])
    assert sampling_from_args(args).seed == 5 and engine_options(args).seed == 3


@pytest.mark.parametrize("command", COMMANDS)
def test_help_says_each_fields_line_and_lists_the_choices(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    squeezed = "".join(text.split())  # wrapped at any width
    for info in fields(EngineOptions):
        assert "".join(info.metadata["says"].split()) in squeezed, info.name
    for name, allowed in CHOICES.items():
        listed = ",".join(str(value) for value in allowed if value is not None)
        assert f"{flag(command, name)} {{{listed}}}" in text


def shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "unset" if default is None else str(default)


def test_readme_lists_every_field_with_its_line() -> None:
    lines = README.read_text().splitlines()
    start = lines.index(TABLE_HEAD) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    expected = [
        f"| `{info.name}` | {shown(info.default)} | {info.metadata['says']} |"
        for info in fields(EngineOptions)
    ]
    assert lines[start:end] == expected, "README's table should read:\n" + "\n".join(expected)
    assert all(re.fullmatch(r"\| `\w+` \| [^|]+ \| [^|]+ \|", row) for row in expected)
