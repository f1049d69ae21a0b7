"""A unity build (kernels/build_units.py): the sources shared out into units the same way on
every machine, each unit naming its sources, and the CPU kernels' sources free of names that
two files of one unit would both define."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from shoal.kernels import cpu_kernels
from shoal.kernels.build_units import share_out, write_units


def sources_of(folder: Path, sizes: dict[str, int]) -> tuple[Path, ...]:
    paths = []
    for name, size in sizes.items():
        path = folder / name
        path.write_text("x" * size)
        paths.append(path)
    return tuple(paths)


def test_the_sources_are_shared_largest_first_to_the_lightest_unit(tmp_path: Path) -> None:
    sources = sources_of(tmp_path, {"a.cpp": 10, "b.cpp": 50, "c.cpp": 30, "d.cpp": 25})
    a, b, c, d = sources
    # b (50) to unit 0, c (30) to 1, d (25) to 1 (30 < 50), a (10) to 0 (50 < 55)
    assert share_out(sources, 2) == [(a, b), (c, d)]
    assert share_out(sources, 1) == [sources]
    assert share_out(sources, 9) == [(b,), (c,), (d,), (a,)]  # no empty unit
    with pytest.raises(ValueError, match="at least 1"):
        share_out(sources, 0)


def test_equal_sizes_keep_the_sources_order(tmp_path: Path) -> None:
    sources = sources_of(tmp_path, {"x.cpp": 8, "y.cpp": 8, "z.cpp": 8})
    x, y, z = sources
    assert share_out(sources, 2) == [(x, z), (y,)]


def test_a_unit_includes_its_sources_by_their_absolute_paths(tmp_path: Path) -> None:
    sources = sources_of(tmp_path, {"a.cpp": 10, "b.cpp": 50, "c.cpp": 30})
    out = tmp_path / "build"
    out.mkdir()
    units = write_units(sources, 2, out)
    assert [unit.name for unit in units] == ["unit_0.cpp", "unit_1.cpp"]
    included = [re.findall(r'^#include "(.*)"$', unit.read_text(), re.M) for unit in units]
    assert included == [
        [str(tmp_path / "b.cpp")],
        [str(tmp_path / "a.cpp"), str(tmp_path / "c.cpp")],
    ]


def test_a_path_an_include_cannot_name_is_refused(tmp_path: Path) -> None:
    (odd := tmp_path / 'say "hi"').mkdir()
    with pytest.raises(ValueError, match="cannot name"):
        write_units(sources_of(odd, {"a.cpp": 1}), 1, tmp_path)


# --- what the CPU kernels' .cpp files keep to themselves -------------------------------------

TOKEN = re.compile(r"#\s*define\s+(\w+)|[A-Za-z_]\w*|::|[{}();=\[\]<>,]")
KEYWORDS = {
    "alignas", "alignof", "decltype", "sizeof", "static_assert", "noexcept", "operator",
    "return", "if", "for", "while", "switch", "template", "typename", "const", "constexpr",
    "inline", "static", "void", "int", "int64_t", "uint16_t", "uint32_t", "float", "bool",
}  # fmt: skip


def strip(source: str) -> str:
    """The source without comments, string and character literals, or directives but #define."""
    source = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    source = re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', '""', source)
    return re.sub(
        r"^\s*#\s*(?:include|if|ifdef|ifndef|elif|else|endif|pragma)[^\n]*", " ", source, flags=re.M
    )


def own_names(source: str) -> set[str]:
    """What one .cpp file defines in its anonymous namespaces (functions, variables, types,
    aliases) and its macros: the names a second file of the same unit could collide with."""
    names: set[str] = set()
    braces: list[str] = []  # "anonymous", "namespace" or "other", innermost last
    statement: list[str] = []
    parens = 0
    for match in TOKEN.finditer(strip(source)):
        if match.group(1):
            names.add(match.group(1))  # a macro: every later file of the unit sees it
            continue
        token = match.group(0)
        in_scope = "anonymous" in braces and "other" not in braces
        if token in ("{", "}", ";") and parens == 0:
            if token == "{" and statement[:1] == ["namespace"]:
                braces.append("anonymous" if len(statement) == 1 else "namespace")
            else:
                if token != "}" and in_scope and statement:
                    names.update(declared(statement))
                if token == "{":
                    braces.append("other")
                elif token == "}":
                    braces.pop()
            statement = []
        else:
            parens += {"(": 1, ")": -1}.get(token, 0)
            statement.append(token)
    return names


def declared(statement: list[str]) -> set[str]:
    """The name a namespace-scope statement declares: a function's (the word before its first
    parenthesis), a variable's (before `=`, `[` or a brace), a type's or an alias's."""
    if statement[0] in ("struct", "class", "enum", "union"):  # its first word not a keyword
        position = 1
        while statement[position] in ("class", "struct", "alignas", "("):
            position = closing(statement, position) if statement[position] == "(" else position + 1
        return {statement[position]}
    if statement[0] == "using":  # an alias, `using a::b;` (b), or `using namespace a;` (none)
        if statement[1] == "namespace":
            return set()
        return {statement[1] if "=" in statement else statement[-1]}
    angles, position = 0, 0
    while position < len(statement):
        token = statement[position]
        angles += {"<": 1, ">": -1}.get(token, 0)
        if angles == 0 and token in ("(", "=", "["):
            name = statement[position - 1] if position else ""
            if token == "(" and (name in KEYWORDS or name.startswith("__")):
                position = closing(statement, position)  # __attribute__((...)), alignas(...)
                continue
            return {name} if re.fullmatch(r"[A-Za-z_]\w*", name) else set()
        position += 1
    last = statement[-1]
    return {last} if re.fullmatch(r"[A-Za-z_]\w*", last) and last not in KEYWORDS else set()


def closing(tokens: list[str], opening: int) -> int:
    """The position after the parenthesis that closes the one at `opening`."""
    depth = 0
    for position in range(opening, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[position], 0)
        if depth == 0:
            return position + 1
    return len(tokens)


def test_the_scan_finds_what_a_file_keeps_to_itself() -> None:
    source = """
#include <x.h>
#define SHOAL_THING 1
namespace shoal_ops { void visible(int a); }
namespace {
// a comment naming fake(
using Vec = at::vec::Vectorized<float>;
using shoal_extend::kRows;
using namespace shoal_decode;
constexpr int64_t kLanes = Vec::size();
template <int MR, bool Gated = true>
__attribute__((target("avx2"))) inline void rows_at(const char* s = "x;{") {
  int local = 3;
}
struct Tile { int inner(); };
struct alignas(64) Config { int rows; };
float table[4] = {1, 2, 3, 4};
}  // namespace
void exported() {}
"""
    assert own_names(source) == {
        "SHOAL_THING",
        "Vec",
        "kRows",
        "kLanes",
        "rows_at",
        "Tile",
        "Config",
        "table",
    }


def test_no_two_cpu_kernel_sources_keep_the_same_name() -> None:
    """A unit compiles several .cpp files as one: a name two of them keep to themselves would
    be defined twice (a build that fails) or, for functions, overloaded (one file could call
    the other's). `Vec`, the same alias of ATen's float vector in each, is the exception."""
    owners: dict[str, list[str]] = defaultdict(list)
    for source in cpu_kernels.SOURCES:
        for name in own_names(source.read_text()):
            owners[name].append(source.name)
    shared = {name: files for name, files in owners.items() if len(files) > 1 and name != "Vec"}
    assert shared == {}
    assert len(owners) > 50  # the scan read the files' names
