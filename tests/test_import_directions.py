"""Which parts of shoal may import which (issue 13): the pure cache knows nothing else, the
kernels know no actors or doors, the actors know no doors, disaggregation's transport knows
neither. Read from the source with `ast`, so an import inside a function or under
TYPE_CHECKING counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# folder -> module prefixes none of its files may import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "cache": ("torch", "asyncio", "shoal."),  # its own modules are imported relatively
    "kernels": ("shoal.actors", "shoal.api"),
    "actors": ("shoal.api",),
    "disagg": ("shoal.api", "shoal.actors"),  # the api side hands the listener its rules
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def violations(folder: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in imported_modules(path):
            for prefix in FORBIDDEN[folder]:
                if module == prefix.rstrip(".") or module.startswith(prefix.rstrip(".") + "."):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_inwards(folder: str) -> None:
    assert violations(folder) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The walker finds imports at any depth, so an empty list above means something."""
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nif True:\n    from shoal.api.engine import Engine\n"
        "def f():\n    import torch.nn\n    from . import sibling\n"
    )
    assert [m for _, m in imported_modules(source)] == ["os", "shoal.api.engine", "torch.nn"]
