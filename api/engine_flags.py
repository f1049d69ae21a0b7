"""The engine's flags on the command line: one per EngineOptions field, made from its declaration.

    add_engine_flags(parser, "serve")     # --page-size N, ..., --prefix-cache / --no-prefix-cache
    options = engine_options(args)        # the EngineOptions they ask for: the one place

Each flag is named after its field (`--max-sessions`), typed from its annotation (a Literal
gives the choices, a bool a --no- form), says the field's line (`option(default, says)` in
config.py) and defaults to the field's default. RENAMED lists the flags a command names
otherwise: on `generate`, `--seed` is the request's (SamplingParams), so the engine's is
`--engine-seed` there. Options that are not plain values (the model) stay with the command.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from types import UnionType
from typing import Any, Union, get_args, get_origin

from shoal.config import CHOICES, OPTION_TYPES, EngineOptions
from shoal.limits import InputLimits

# command -> {EngineOptions field: the flag's name there}, only where it is not the field's own
RENAMED = {"generate": {"seed": "engine_seed"}}  # --seed there: the request's (SamplingParams)
ALIASES = {"pipeline_stages": ("--pp",)}  # SGLang's short name


def add_engine_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """A flag per EngineOptions field; the input limits' in a group of their own."""
    engine = parser.add_argument_group("engine (EngineOptions; a flag not given: its default)")
    limits = parser.add_argument_group("input limits, every door (docs/limits.md)")
    renamed = RENAMED.get(command, {})
    for info in fields(EngineOptions):
        group = limits if info.name in InputLimits.__struct_fields__ else engine
        dest = renamed.get(info.name, info.name)
        flag = "--" + dest.replace("_", "-")
        kind = _without_none(OPTION_TYPES[info.name])
        shown = "unset" if info.default is None else info.default
        if kind is bool:
            shown = flag if info.default else "--no-" + flag[2:]
            more: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        elif allowed := [value for value in CHOICES.get(info.name, ()) if value is not None]:
            more = {"choices": allowed}
        else:
            more = {"type": kind}
        says = f"{info.metadata['says']} (default: {shown})".replace("%", "%%")
        names = [flag, *ALIASES.get(dest, ())]
        group.add_argument(*names, dest=dest, default=info.default, help=says, **more)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The EngineOptions the flags of add_engine_flags ask for (not validated: Engine does)."""
    renamed = RENAMED.get(args.command, {})
    given = {
        info.name: getattr(args, renamed.get(info.name, info.name))
        for info in fields(EngineOptions)
    }
    return EngineOptions(**given)


def _without_none(kind: Any) -> Any:
    """int | None -> int."""
    if get_origin(kind) in (Union, UnionType):
        [kind] = [part for part in get_args(kind) if part is not type(None)]
    return kind
