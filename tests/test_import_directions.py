"""Which parts of shoal may import which: every top-level folder has the parts it may import
listed, the actors' folders import only the actors' shared level, and no two folders import
each other, however indirectly. Read from the source with `ast`, so an import inside a
function or under TYPE_CHECKING counts too.

    cache     pure data structures: nothing of shoal, no torch, no asyncio
    kernels   device code and its references
    loading   checkpoints into ModelConfig and weights          over kernels
              (given a family's traits and shapes, knowing no family)
    models    the decoder families; load_model resolves one     over loading, kernels
    disagg    disaggregation's transport                        nothing of shoal's parts
    actors    the actors                                        over all of the above
    api       the doors                                         over everything

The top-level modules (results.py, params.py, limits.py, config.py, resolve_options.py,
memory.py, heap.py) are the vocabulary every part shares.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_MODULES = ("results", "params", "limits", "config", "resolve_options", "memory", "heap")
VOCABULARY = tuple(f"shoal.{name}" for name in TOP_MODULES)

# folder -> what its files may import of shoal (its own folder always)
ALLOWED: dict[str, tuple[str, ...]] = {
    "cache": (),
    "kernels": ("shoal.params", "shoal.results"),
    "loading": ("shoal.kernels", *VOCABULARY),
    "models": ("shoal.loading", "shoal.kernels", *VOCABULARY),
    "disagg": ("shoal.results",),
    "actors": (
        *("shoal.cache", "shoal.kernels", "shoal.loading", "shoal.models", "shoal.disagg"),
        *VOCABULARY,
    ),
    "api": ("shoal",),
}
NOT_SHOAL: dict[str, tuple[str, ...]] = {"cache": ("torch", "asyncio")}
SKIPPED = {"tests", "bench", "build", ".venv"}  # not parts of the package
ACTOR_FOLDERS = ("tokenizer", "scheduler", "cache_manager", "executor", "transfer")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def sources(folder: str) -> Iterator[Path]:
    yield from sorted((ROOT / folder).rglob("*.py"))


def folders() -> list[str]:
    """Every top-level folder that is a part of the package (has an __init__.py)."""
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_every_folder_has_its_rule() -> None:
    assert folders() == sorted(ALLOWED)


def may_import(folder: str, module: str) -> bool:
    if any(within(module, name) for name in NOT_SHOAL.get(folder, ())):
        return False
    if not within(module, "shoal") or within(module, f"shoal.{folder}"):
        return True
    return any(within(module, allowed) for allowed in ALLOWED[folder])


def violations(folder: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(folder)
        for line, module in imported_modules(path)
        if not may_import(folder, module)
    ]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_inwards(folder: str) -> None:
    assert violations(folder) == []


def test_an_actor_imports_no_other_actors_folder() -> None:
    """Actors talk through messages: a folder of one imports the shared level (mailbox,
    messages, replies, supervise) and its own files, never another actor's."""
    bad = []
    for actor in ACTOR_FOLDERS:
        for path in sources(f"actors/{actor}"):
            for line, module in imported_modules(path):
                for other in ACTOR_FOLDERS:
                    if other != actor and within(module, f"shoal.actors.{other}"):
                        bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


def part_of(module: str) -> str | None:
    """'shoal.models.decoder' -> 'models'; 'shoal.config' -> 'config'; None outside shoal."""
    parts = module.split(".")
    if parts[0] != "shoal" or len(parts) < 2:
        return None
    return parts[1]


def test_no_two_parts_import_each_other() -> None:
    """The graph of the folders and top-level modules, an edge for each import between two
    of them, has no cycle through a folder."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIPPED or rel.parts[0].startswith("."):
            continue
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for _, module in imported_modules(path):
            target = part_of(module)
            if target is not None and target != source:
                edges.setdefault(source, set()).add(target)
    cycles = [c for c in strongly_connected(edges) if len(c) > 1 and set(c) & set(ALLOWED)]
    assert cycles == []


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(sorted(component))

    for node in sorted(set(edges) | {n for targets in edges.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The walker finds imports at any depth, so an empty list above means something."""
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nif True:\n    from shoal.api.engine import Engine\n"
        "def f():\n    import torch.nn\n    from . import sibling\n"
    )
    assert [m for _, m in imported_modules(source)] == ["os", "shoal.api.engine", "torch.nn"]


def test_the_cycle_check_sees_a_cycle() -> None:
    edges = {"loading": {"models"}, "models": {"loading", "kernels"}, "kernels": set()}
    assert [c for c in strongly_connected(edges) if len(c) > 1] == [["loading", "models"]]


def test_the_package_lists_every_folder() -> None:
    """pyproject.toml's packages name every folder with an __init__.py (else a wheel lacks it)."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(text.split("packages = [", 1)[1].split("]", 1)[0].replace('"', "").split(","))
    listed = {name.strip() for name in listed if name.strip()}
    parts = [p.parent.relative_to(ROOT).parts for p in ROOT.rglob("__init__.py")]
    found = {".".join(("shoal", *part)) for part in parts if not set(part[:1]) & SKIPPED}
    assert listed == found
