"""`python -m shoal cache list | size | clean`: what the cache holds, and removing what no start
would load again (loading/cache_inventory.py says what counts as stale, and why)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from shoal.kernels import cpu_kernels
from shoal.kernels.kernel_build import build_folder
from shoal.loading.cache_inventory import (
    CacheEntry,
    Environment,
    describe_age,
    inventory,
    remove,
)
from shoal.loading.loader import default_cache_dir


def add_cache_parser(commands: Any) -> None:
    """The `cache` subcommand on the CLI's subparsers."""
    cache = commands.add_parser(
        "cache", help="list, size or clean the model and kernel cache ($SHOAL_CACHE_DIR)"
    )
    cache.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $SHOAL_CACHE_DIR or ~/.cache/shoal"
    )
    actions = cache.add_subparsers(dest="cache_action", required=True)
    actions.add_parser("list", help="every converted model, kernel build and temporary folder")
    actions.add_parser("size", help="the total size, and by kind")
    clean = actions.add_parser(
        "clean",
        help="remove what no start would load again (stale); --all: everything not in use",
    )
    clean.add_argument(
        "--all", action="store_true", help="also what is live: the next start converts and builds"
    )
    clean.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")


def run_cache_command(args: argparse.Namespace) -> int:
    cache_dir = (args.cache_dir or default_cache_dir()).expanduser()
    if not cache_dir.is_dir():
        print(f"{cache_dir}: no cache yet")
        return 0
    entries = inventory(cache_dir, this_environment(cache_dir))
    if args.cache_action == "list":
        for entry in entries:
            print(_line(entry, cache_dir))
        if not entries:
            print(f"{cache_dir}: empty")
    elif args.cache_action == "size":
        print(_sizes(entries, cache_dir))
    else:
        return _clean(entries, cache_dir, everything=args.all, dry_run=args.dry_run)
    return 0


def this_environment(cache_dir: Path) -> Environment:
    """The kernel build this environment loads from `cache_dir`, and its torch."""
    return Environment(
        kernel_folders=frozenset({build_folder(cpu_kernels.spec(), cache_dir).name}),
        torch_location=str(Path(torch.__file__).resolve().parent),
    )


def _clean(entries: list[CacheEntry], cache_dir: Path, *, everything: bool, dry_run: bool) -> int:
    freed = 0
    for entry in entries:
        if entry.kind == "other" or entry.busy or not (everything or entry.stale):
            continue
        why = entry.stale or "live"
        name = entry.path.relative_to(cache_dir)
        if dry_run:
            print(f"would remove {name} ({why}, {_bytes(entry.size_bytes)})")
        elif remove(entry):
            print(f"removed {name} ({why}, {_bytes(entry.size_bytes)})")
        else:
            print(f"kept {name}: in use", file=sys.stderr)
            continue
        freed += entry.size_bytes
    print(f"{'would free' if dry_run else 'freed'} {_bytes(freed)} in {cache_dir}")
    return 0


def _line(entry: CacheEntry, cache_dir: Path) -> str:
    if entry.busy:
        state = "in use"
    elif entry.stale:
        state = f"stale: {entry.stale}"
    else:
        state = "complete" if entry.complete else "incomplete"
    source = f"  [{entry.source}]" if entry.source else ""
    return (
        f"{entry.kind:<9} {_bytes(entry.size_bytes):>9}  {describe_age(entry.modified)}  "
        f"{entry.path.relative_to(cache_dir)}  {state}{source}"
    )


def _sizes(entries: list[CacheEntry], cache_dir: Path) -> str:
    by_kind: dict[str, int] = {}
    for entry in entries:
        by_kind[entry.kind] = by_kind.get(entry.kind, 0) + entry.size_bytes
    total = sum(by_kind.values())
    parts = ", ".join(f"{kind} {_bytes(size)}" for kind, size in sorted(by_kind.items()))
    stale = sum(entry.size_bytes for entry in entries if entry.stale and not entry.busy)
    return (
        f"{_bytes(total)} in {cache_dir} ({parts or 'nothing'}); "
        f"{_bytes(stale)} stale (`shoal cache clean` removes it)"
    )


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
