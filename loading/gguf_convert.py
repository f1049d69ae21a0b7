"""Convert a llama.cpp GGUF file into an HF-style folder, once.

The converted folder is an ordinary Hugging Face checkpoint, so everything downstream (our loader,
and transformers itself in tests) reads it like any other:

    <cache_dir>/<gguf stem>-<conversion key>/
        config.json              what transformers' save_pretrained writes for the model the
                                 metadata describes (gguf_config.py: which architectures)
        generation_config.json   bos / eos / pad ids from the GGUF tokenizer metadata
        model.safetensors        every tensor dequantized to float32 under its HF name, with
                                 llama.cpp's changes to the values undone (gguf_tensors.py)
        tokenizer.json           the fast tokenizer transformers builds from the GGUF metadata
        tokenizer_config.json    special tokens and the GGUF's chat_template
        shoal-converted.json     the marker: written last, so a folder without it is half-written

The conversion key is cheap (file name, size, mtime and CONVERTER_VERSION), never a hash of the
whole file. The marker records each file's size and SHA-256 (model_cache.py), checked at every
load: a corrupted folder is refused with a message that says which folder to delete.

How the cache stays whole (cache_files.py has the locks and private folders):
- a conversion holds the folder's lock exclusively; a second process converting the same file
  waits for it (bounded, logged) and then loads its result;
- it writes into `.<name>.tmp-<pid>-<hex>/`, fsyncs and seals it, and renames it into place, so
  a folder without its marker never appears; the private folder is removed on every exit
  Python sees (an exception, a full disk, a cancelled start); one left by a SIGKILL is removed
  by the next start that finds its lock free;
- once in place, older conversions of the same source (a reinstalled package has a new mtime,
  so a new key) are removed unless a process is loading them (model_cache.prune_superseded);
- a load holds the lock shared while it reads, so `shoal cache clean` never removes a folder
  being read;
- a start cancelled by a signal (`cancel` set) stops between tensors: StartCancelled.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from shoal.kernels.cache_files import (
    FolderLock,
    LockBusy,
    make_private,
    publish,
    raise_if_cancelled,
    remove_folder,
    sweep_dead,
    sweep_temporaries,
)
from shoal.loading.gguf_config import SUPPORTED_ARCHITECTURES, gguf_hf_config
from shoal.loading.gguf_metadata import GGUFMetadata
from shoal.loading.gguf_tensors import gguf_weights, hf_name, unpermute_rope_rows
from shoal.loading.model_cache import (
    MARKER_NAME,
    is_converted,
    prune_superseded,
    seal,
    verify,
)

__all__ = [
    "CONVERTER_VERSION",
    "MARKER_NAME",
    "SUPPORTED_ARCHITECTURES",
    "ConversionError",
    "convert_gguf",
    "converted",
    "converted_folder",
    "gguf_hf_config",
    "gguf_weights",
    "hf_name",
    "is_converted",
    "unpermute_rope_rows",
]

# Bump when the converted output changes, so old cache folders are not reused.
# 2: config.json in transformers 5's spelling; qwen2, qwen3, qwen3moe, mixtral, gemma2/3, phi3.
# 3: the marker records every file's size and SHA-256 (verified at load).
CONVERTER_VERSION = 3
WAIT_S = 600.0  # the longest a start waits for another process converting the same file


class ConversionError(ValueError):
    """The conversion could not be written (a full disk, a read-only cache...) or waited for."""


def conversion_key(gguf_path: Path) -> str:
    """A short key that changes when the file (name, size, mtime) or the converter changes."""
    st = gguf_path.stat()
    text = f"{gguf_path.name}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def converted_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf_path` lives (whether or not it exists yet)."""
    return cache_dir / f"{gguf_path.stem}-{conversion_key(gguf_path)}"


@contextmanager
def converted(
    gguf_path: Path,
    cache_dir: Path,
    *,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> Iterator[Path]:
    """The verified conversion of `gguf_path` (converted first if need be), held for reading
    (its lock shared) until the block ends. CorruptCacheError (a ValueError) when it fails
    verification; in a read-only cache it is read without a lock (nobody can change it)."""
    folder = converted_folder(gguf_path, cache_dir)
    if any(cache_dir.glob(".*.tmp-*")):
        sweep_dead(cache_dir)  # private folders of conversions killed earlier
    if not is_converted(folder):
        convert_gguf(gguf_path, folder, progress=progress, cancel=cancel)
    try:
        lock = FolderLock.take(
            folder, exclusive=False, doing="loading it", wait_s=WAIT_S, cancel=cancel
        )
    except LockBusy as error:
        raise ConversionError(f"{folder} stays busy: {error}") from error
    except OSError:
        lock = None  # a read-only cache
    try:
        if not is_converted(folder):
            raise ConversionError(f"{folder} was removed while this start loaded it; start again")
        verify(folder)
        yield folder
    finally:
        if lock is not None:
            lock.release()


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    cancel: threading.Event | None = None,
) -> Path:
    """Convert `gguf_path` into `out_dir` unless a complete conversion is already there.
    ConversionError (a ValueError, one line) when it cannot be written; StartCancelled when
    `cancel` is set meanwhile. Either way nothing of it is left behind."""
    if is_converted(out_dir):
        return out_dir
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = FolderLock.take(
            out_dir,
            exclusive=True,
            doing=f"converting {gguf_path.name}",
            wait_s=WAIT_S,
            cancel=cancel,
        )
    except LockBusy as error:
        raise ConversionError(f"{gguf_path.name} could not be converted: {error}") from error
    except OSError as error:
        raise ConversionError(_write_failure(gguf_path, out_dir, error)) from error
    with lock:
        if is_converted(out_dir):
            return out_dir  # converted by the process we waited for
        try:
            sweep_temporaries(out_dir)  # dead: we hold the lock
            remove_folder(out_dir)  # a half-written one (no marker) from an older version
            tmp = make_private(out_dir)
        except OSError as error:
            raise ConversionError(_write_failure(gguf_path, out_dir, error)) from error
        try:
            _convert_into(gguf_path, tmp, progress=progress, cancel=cancel)
            raise_if_cancelled(cancel)
            seal(tmp, gguf_path, CONVERTER_VERSION)
            publish(tmp, out_dir)
        except OSError as error:
            raise ConversionError(_write_failure(gguf_path, out_dir, error)) from error
        finally:
            remove_folder(tmp)
        prune_superseded(out_dir)
    return out_dir


def _write_failure(gguf_path: Path, out_dir: Path, error: OSError) -> str:
    """One line for a conversion that could not be written (or read)."""
    where = out_dir.parent
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            needed = f" (it needs several times the GGUF's {gguf_path.stat().st_size >> 20} MB)"
        except OSError:
            needed = ""
        return (
            f"converting {gguf_path.name} into {where} failed: no space left on the device"
            f"{needed}; free some, or point SHOAL_CACHE_DIR at another disk"
        )
    what = error.strerror or str(error)
    name = f" ({error.filename})" if error.filename else ""
    return f"converting {gguf_path.name} into {where} failed: {what}{name}"


class _Steps(tqdm):
    """The conversion's progress bar; each step first checks whether the start was cancelled."""

    def __init__(self, *args: Any, cancel: threading.Event | None, **kwargs: Any) -> None:
        self._cancel = cancel
        super().__init__(*args, **kwargs)

    def update(self, n: float | None = 1) -> bool | None:
        raise_if_cancelled(self._cancel)
        return super().update(n)


def _convert_into(
    gguf_path: Path, folder: Path, *, progress: bool, cancel: threading.Event | None
) -> None:
    from safetensors.torch import save_file

    gguf = importlib.import_module("gguf")

    with _Steps(
        total=3,
        desc=f"converting {gguf_path.name}",
        unit="step",
        disable=not progress,
        cancel=cancel,
    ) as bar:
        bar.set_postfix_str("reading GGUF")
        meta = GGUFMetadata(gguf.GGUFReader(gguf_path))
        config = gguf_hf_config(meta)
        bar.update()
        bar.total = 3 + len(meta.tensors)
        bar.set_postfix_str("dequantizing")
        weights = gguf_weights(meta, config, bar)
        bar.set_postfix_str("writing safetensors")
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del weights
        bar.update()
        bar.set_postfix_str("tokenizer")
        _write_json(folder / "config.json", config)
        generation = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(folder / "generation_config.json", generation)
        _write_tokenizer(gguf_path, folder, model_max_length=config["max_position_embeddings"])
        bar.update()


def _write_tokenizer(gguf_path: Path, folder: Path, *, model_max_length: int) -> None:
    """Save the fast tokenizer transformers builds from the GGUF metadata (chat template too).

    PreTrainedTokenizerFast reads only the tokenizer metadata (under a second); AutoTokenizer
    with gguf_file would also parse the whole file again for a config (several seconds) and
    gives the same tokenizer.
    """
    # Imported by name, not statically: see loading/hf_tokenizer.py.
    transformers = importlib.import_module("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.model_max_length = model_max_length
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
