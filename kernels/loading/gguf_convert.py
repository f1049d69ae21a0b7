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
whole file. Conversion happens in a temporary sibling folder that is renamed into place after the
marker is written, so a crash or a concurrent conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal.kernels.loading.gguf_config import SUPPORTED_ARCHITECTURES, gguf_hf_config
from shoal.kernels.loading.gguf_metadata import GGUFMetadata
from shoal.kernels.loading.gguf_tensors import gguf_weights, hf_name, unpermute_rope_rows

__all__ = [
    "CONVERTER_VERSION",
    "MARKER_NAME",
    "SUPPORTED_ARCHITECTURES",
    "convert_gguf",
    "converted_folder",
    "gguf_hf_config",
    "gguf_weights",
    "hf_name",
    "is_converted",
    "unpermute_rope_rows",
]

# Bump when the converted output changes, so old cache folders are not reused.
# 2: config.json in transformers 5's spelling; qwen2, qwen3, qwen3moe, mixtral, gemma2/3, phi3.
CONVERTER_VERSION = 2
MARKER_NAME = "shoal-converted.json"
_STALE_TMP_AGE_S = 3600.0


def conversion_key(gguf_path: Path) -> str:
    """A short key that changes when the file (name, size, mtime) or the converter changes."""
    st = gguf_path.stat()
    text = f"{gguf_path.name}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def converted_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf_path` lives (whether or not it exists yet)."""
    return cache_dir / f"{gguf_path.stem}-{conversion_key(gguf_path)}"


def is_converted(folder: Path) -> bool:
    return (folder / MARKER_NAME).is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` into `out_dir` unless a complete conversion is already there."""
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_folders(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, tmp, progress=progress)
        marker = {
            "source": str(gguf_path),
            "size": gguf_path.stat().st_size,
            "mtime_ns": gguf_path.stat().st_mtime_ns,
            "converter_version": CONVERTER_VERSION,
        }
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary folder
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2))  # last write
        if out_dir.exists() and not is_converted(out_dir):
            shutil.rmtree(out_dir)  # a half-written folder (no marker) from an older crash
        if not out_dir.exists():
            try:
                os.replace(tmp, out_dir)
            except OSError:
                if not is_converted(out_dir):  # not a concurrent conversion finishing first
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _remove_stale_tmp_folders(out_dir: Path) -> None:
    """Delete temporary folders of conversions that died long ago (a live one takes seconds)."""
    now = time.time()
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_AGE_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _convert_into(gguf_path: Path, folder: Path, *, progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    gguf = importlib.import_module("gguf")

    with tqdm(
        total=3, desc=f"converting {gguf_path.name}", unit="step", disable=not progress
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
    # Imported by name, not statically: see HFTokenizer in loader.py.
    transformers = importlib.import_module("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.model_max_length = model_max_length
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
