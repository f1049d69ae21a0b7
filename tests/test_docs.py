"""The documentation stays inside the repository and true to its files (issue 13):

(a) no source, markdown or toml file refers to a path outside the repository (a clone has none);
(b) every relative link in README.md and docs/*.md reaches a file, and an `#anchor` into a
    markdown file reaches one of its headings (GitHub's slugs);
(c) every file outside tests/ over 300 lines is named in docs/architecture.md's
    "Files over 300 lines", with its reason;
(d) docs/architecture.md's "Folder map" is the tree: every top-level folder and every folder
    that holds Python outside tests/ has its row, and every path a row names exists (a bare
    name in the row's own folder, or from the root).

Each check is a function over a folder; the last tests run it on a small broken tree, so an
empty list above means something."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = Path("docs") / "architecture.md"
LONG_SECTION = "Files over 300 lines"
MAP_SECTION = "Folder map"
MAX_LINES = 300

# Never part of the repository: environments, caches and build outputs.
SKIPPED_DIRS = frozenset(
    {".venv", ".git", "build", "dist", "__pycache__", ".hypothesis", ".ruff_cache"}
    | {".mypy_cache", ".pytest_cache", "node_modules"}
)
SCANNED_SUFFIXES = (".py", ".md", ".toml")
# Where the design used to live, beside the repository rather than in it.
OUTSIDE_PATHS = ("../shared", "DESIGN.md")

# A backticked name in the folder map that names a file or folder: `actors/`, `kv.py`, `csrc/*.cpp`.
PATH_LIKE = re.compile(r"[\w.*-]+(/[\w.*-]*)*")
PATH_SUFFIXES = (".py", ".md", ".toml", ".cpp", ".h", ".json", ".jsonl")

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def repository_files(root: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Every file under root with one of the suffixes, outside SKIPPED_DIRS and *.egg-info."""
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        if path.is_file() and path.suffix in suffixes:
            yield path


# ---- (a) nothing outside the repository ------------------------------------------------------


def outside_references(root: Path, skip: frozenset[Path] = frozenset()) -> list[str]:
    bad = []
    for path in repository_files(root, SCANNED_SUFFIXES):
        if path in skip:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for needle in OUTSIDE_PATHS:
                if needle in line:
                    bad.append(f"{path.relative_to(root)}:{number} names {needle}")
    return bad


def test_nothing_refers_outside_the_repository() -> None:
    assert outside_references(ROOT, frozenset({Path(__file__).resolve()})) == []


# ---- (b) links resolve -----------------------------------------------------------------------


def outside_fences(text: str) -> Iterator[str]:
    """The lines of a markdown text that are not in a fenced code block."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation but `-` and
    `_` removed, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in outside_fences(path.read_text()):
        match = HEADING.match(line)
        if match is None:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(root: Path, documents: list[Path]) -> list[str]:
    bad = []
    for doc in documents:
        for line in outside_fences(doc.read_text()):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                where, _, anchor = target.partition("#")
                dest = (doc.parent / where).resolve() if where else doc.resolve()
                name = f"{doc.relative_to(root)}: {target}"
                if not dest.is_relative_to(root.resolve()):
                    bad.append(f"{name} leaves the repository")
                elif not dest.exists():
                    bad.append(f"{name} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{name} names no heading of {dest.name}")
    return bad


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_links_in_the_readme_and_docs_resolve() -> None:
    assert broken_links(ROOT, documents(ROOT)) == []


def test_the_architecture_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"]({ARCHITECTURE.as_posix()})" in readme


# ---- (c) long files are explained ------------------------------------------------------------


def section(path: Path, title: str) -> str:
    """The text under the level-2 heading `title`, up to the next level-2 heading."""
    lines = path.read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def long_files(root: Path) -> list[str]:
    """Files outside tests/ over MAX_LINES lines, as paths from the root."""
    out = []
    for path in repository_files(root, (".py",)):
        rel = path.relative_to(root)
        if rel.parts[0] == "tests":
            continue
        if len(path.read_text(errors="replace").splitlines()) > MAX_LINES:
            out.append(rel.as_posix())
    return out


def unexplained_long_files(root: Path) -> list[str]:
    explained = section(root / ARCHITECTURE, LONG_SECTION)
    return [name for name in long_files(root) if f"`{name}`" not in explained]


def test_every_long_file_says_why() -> None:
    assert unexplained_long_files(ROOT) == []


# ---- (d) the folder map is the tree ----------------------------------------------------------


def map_folders(root: Path) -> list[str]:
    """The folders the map must name, as "name/": every top-level folder, and every folder that
    holds Python outside tests/, at any depth; never a hidden one, SKIPPED_DIRS or *.egg-info."""
    found = set()
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(p in SKIPPED_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        if len(parts) == 1 and path.is_dir():
            found.add(f"{parts[0]}/")
        elif len(parts) > 1 and parts[0] != "tests" and path.suffix == ".py":
            found.add("/".join(parts[:-1]) + "/")
    return sorted(found)


def map_rows(root: Path) -> list[tuple[str, list[str]]]:
    """Each row of the map's table: its path (the first cell) and every path it names, in
    backticks outside a link's text (links are check (b)'s)."""
    rows = []
    for line in section(root / ARCHITECTURE, MAP_SECTION).splitlines():
        if not line.startswith("|"):
            continue
        first = re.findall(r"`([^`]+)`", line.split("|")[1])
        if not first:
            continue  # the header, the rule
        named = re.findall(r"`([^`]+)`", re.sub(r"\[[^\]]*\]\([^)]*\)", "", line))
        rows.append((first[0], [name for name in named if names_a_path(name)]))
    return rows


def names_a_path(name: str) -> bool:
    return PATH_LIKE.fullmatch(name) is not None and ("/" in name or name.endswith(PATH_SUFFIXES))


def resolves(root: Path, row: str, name: str) -> bool:
    """A name is in its row's folder (a folder row), or else from the root."""
    here = root / row if row.endswith("/") else root
    return any(
        any(base.glob(name)) if "*" in name else (base / name).exists() for base in (here, root)
    )


def map_paths_missing(root: Path) -> list[str]:
    return [
        f"{row}: {name}"
        for row, names in map_rows(root)
        for name in names
        if not resolves(root, row, name)
    ]


def map_folders_unnamed(root: Path) -> list[str]:
    named = set()
    for row, names in map_rows(root):
        here = row if row.endswith("/") else ""
        for name in names:
            if name.endswith("/"):
                named.add(name)
                named.add(here + name)
    return [folder for folder in map_folders(root) if folder not in named]


def test_every_folder_has_its_row_in_the_map() -> None:
    assert map_folders_unnamed(ROOT) == []


def test_every_path_the_map_names_exists() -> None:
    assert map_paths_missing(ROOT) == []


# ---- each check can fail ---------------------------------------------------------------------


def broken_tree(root: Path) -> None:
    (root / "docs").mkdir()
    (root / "pkg").mkdir()
    (root / "tests").mkdir()
    (root / "README.md").write_text(
        "[design](docs/architecture.md) [gone](docs/gone.md) [up](../elsewhere.md)\n"
        "[law](docs/architecture.md#law-1-idle-means-nothing) [no](docs/architecture.md#nope)\n"
        "```\n[in a fence](docs/not-checked.md)\n```\n"
    )
    (root / ARCHITECTURE).write_text(
        "# Design\n\n## Law 1: idle means `nothing`\n\n## Files over 300 lines\n\n"
        "- `pkg/explained.py`: one idea.\n\n## After\n\n- `pkg/long.py` is not in the section.\n"
    )
    long = "x = 1\n" * (MAX_LINES + 1)
    (root / "pkg" / "long.py").write_text(long)
    (root / "pkg" / "explained.py").write_text(long)
    (root / "tests" / "test_long.py").write_text(long)  # tests may be long
    (root / "pkg" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (root / "pkg" / "notes.toml").write_text('design = "../shared/DESIGN.md"\n')


def test_the_checks_see_what_is_wrong(tmp_path: Path) -> None:
    broken_tree(tmp_path)
    assert outside_references(tmp_path) == [
        "pkg/notes.toml:1 names ../shared",
        "pkg/notes.toml:1 names DESIGN.md",
    ]
    assert broken_links(tmp_path, documents(tmp_path)) == [
        "README.md: docs/gone.md does not exist",
        "README.md: ../elsewhere.md leaves the repository",
        "README.md: docs/architecture.md#nope names no heading of architecture.md",
    ]
    assert long_files(tmp_path) == ["pkg/explained.py", "pkg/long.py"]
    assert unexplained_long_files(tmp_path) == ["pkg/long.py"]


def test_github_slugs() -> None:
    assert github_slug("Law 1: idle means nothing anywhere") == "law-1-idle-means-nothing-anywhere"
    assert github_slug("Matmuls: `kernels/linear.py`") == "matmuls-kernelslinearpy"
    assert github_slug("Who may ask (api/http_guard.py)") == "who-may-ask-apihttp_guardpy"
    assert github_slug("See [the brief](design-brief.md)") == "see-the-brief"


def broken_map(root: Path) -> None:
    (root / "docs").mkdir()
    (root / ARCHITECTURE).write_text(
        "# Design\n\n## Folder map\n\n| path | what |\n| --- | --- |\n"
        "| `pkg/` | `mod.py`, `gone.py`, `sub/`, `data/*.csv`, [`up.md`](up.md), `Engine.run` |\n"
        "| `old/` | moved out |\n"
        "| `top.py` | over `pkg/mod.py` and `pkg/sub/deep.py` |\n\n"
        "## Next\n\n| `other/` | after the map: not a row of it |\n"
    )
    for name in ("top.py", "pkg/mod.py", "pkg/sub/deep.py", "pkg/data/a.csv", "other/x.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    for name in ("other/inner/y.py", "tests/unit/test_z.py", ".venv/lib/v.py", "p.egg-info/e.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    (root / "assets").mkdir()  # a top-level folder without Python is named too


def test_the_map_check_sees_what_is_wrong(tmp_path: Path) -> None:
    broken_map(tmp_path)
    assert map_folders(tmp_path) == [
        "assets/",
        "docs/",
        "other/",
        "other/inner/",
        "pkg/",
        "pkg/sub/",
        "tests/",
    ]
    assert map_paths_missing(tmp_path) == ["pkg/: gone.py", "old/: old/"]
    assert map_folders_unnamed(tmp_path) == ["assets/", "docs/", "other/", "other/inner/", "tests/"]
