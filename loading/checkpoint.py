"""What a checkpoint folder must hold before any of it may touch a live model.

    folder/
      config.json                    a JSON object; its fields are checked in config.py
      generation_config.json         optional, a JSON object
      model.safetensors              the weights in one file, or
      model.safetensors.index.json   {"weight_map": {tensor name: shard file name}} and the
                                     shards it names, all in the folder itself

A safetensors file is

    [8 bytes: N, little-endian u64][N bytes: JSON header][data section: every tensor's bytes]

and its header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte
offsets into the data section), next to an optional "__metadata__" object of strings. The
tensors must tile the data section exactly, as the safetensors library requires.

Only headers and small JSON files are read here, never tensor data. Every failure is a
CheckpointError whose message is for whoever sent the checkpoint: it names files only relative
to the folder (never an absolute path) and says what is wrong with them, not how we failed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100 * 1024 * 1024  # a header (or a JSON file) larger than this is refused
HEADER_LENGTH_BYTES = 8

# The floating dtypes the loader casts from, with their size in bytes.
ACCEPTED_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


class CheckpointError(ValueError):
    """A checkpoint is unusable. The message is safe to show the client (see module doc)."""


@dataclass(frozen=True)
class TensorEntry:
    file_name: str  # relative to the checkpoint folder
    dtype: str  # a key of ACCEPTED_DTYPES
    shape: tuple[int, ...]


def check_folder(path: Path) -> Path:
    """`path` if it is a folder with config.json and safetensors weights."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except (OSError, ValueError):  # an unreadable parent, a name the OS cannot encode
        exists = is_dir = False
    if not exists:
        raise CheckpointError("the checkpoint path does not exist")
    if not is_dir:
        raise CheckpointError("the checkpoint path is a file, not a model folder (or a .gguf)")
    missing = []
    if not (path / CONFIG_NAME).is_file():
        missing.append(CONFIG_NAME)
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise CheckpointError(f"the checkpoint folder is missing {' and '.join(missing)}")
    return path


def read_json_object(folder: Path, name: str) -> dict[str, Any]:
    """The JSON object in folder/name (a bounded read)."""
    path = folder / name
    try:
        if not path.is_file():
            raise CheckpointError(f"{name}: the file is missing")
        if path.stat().st_size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{name}: the file is larger than {MAX_HEADER_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{name}: the file could not be read") from exc
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{name}: the file is not UTF-8 text") from exc
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise CheckpointError(f"{name}: the file is not valid JSON ({exc.msg} at {where})") from exc
    except RecursionError as exc:
        raise CheckpointError(f"{name}: the JSON is nested too deeply") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{name}: must be a JSON object, got {json_kind(value)}")
    return value


def read_tensor_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the folder's safetensors files (the index's shards if there is an
    index, else model.safetensors, else every *.safetensors), from their headers."""
    weight_map = _read_weight_map(folder) if (folder / INDEX_NAME).exists() else None
    if weight_map is not None:
        file_names = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE_NAME).exists():
        file_names = [SINGLE_FILE_NAME]
    else:
        file_names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not file_names:
        raise CheckpointError("the checkpoint folder has no *.safetensors weights")
    entries: dict[str, TensorEntry] = {}
    for file_name in file_names:
        for name, entry in read_header(folder, file_name).items():
            if name in entries:
                raise CheckpointError(
                    f"{file_name}: tensor {name} is also in {entries[name].file_name}"
                )
            entries[name] = entry
    for name, file_name in (weight_map or {}).items():
        if name not in entries or entries[name].file_name != file_name:
            raise CheckpointError(f"{INDEX_NAME}: tensor {name} is not in {file_name}")
    return entries


def check_entries(entries: dict[str, TensorEntry], expected: dict[str, tuple[int, ...]]) -> None:
    """Each expected tensor present with its shape, and nothing unexpected."""
    missing = [name for name in expected if name not in entries]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"the checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        entry = entries[name]
        if entry.shape != shape:
            raise CheckpointError(
                f"{entry.file_name}: tensor {name} has shape {entry.shape}, expected {shape}"
            )
    unexpected = [name for name in entries if name not in expected]
    if unexpected:
        raise CheckpointError(f"the checkpoint has unexpected tensor {unexpected[0]}")


def read_header(folder: Path, file_name: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, each checked against the layout in the module doc."""
    path = folder / file_name
    try:
        if not path.is_file():
            raise CheckpointError(f"{file_name}: the file is missing")
        with path.open("rb") as f:
            file_bytes = path.stat().st_size
            if file_bytes < HEADER_LENGTH_BYTES:
                what = "empty" if file_bytes == 0 else f"only {file_bytes} bytes long"
                raise CheckpointError(f"{file_name}: the file is {what}, not safetensors")
            (header_bytes,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
            if header_bytes > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{file_name}: the header length {header_bytes} is over the limit "
                    f"of {MAX_HEADER_BYTES} bytes"
                )
            if header_bytes > file_bytes - HEADER_LENGTH_BYTES:
                raise CheckpointError(
                    f"{file_name}: the header length {header_bytes} runs past the end of "
                    f"the file ({file_bytes} bytes)"
                )
            raw = f.read(header_bytes)
    except OSError as exc:
        raise CheckpointError(f"{file_name}: the file could not be read") from exc
    if len(raw) != header_bytes:
        raise CheckpointError(f"{file_name}: the file is shorter than its header length")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{file_name}: the header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file_name}: the header must be a JSON object, got {json_kind(header)}"
        )
    data_bytes = file_bytes - HEADER_LENGTH_BYTES - header_bytes
    return _entries(file_name, header, data_bytes)


def json_kind(value: object) -> str:
    """How a JSON value reads in a message: null, true, 3, "30", a list, an object."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return json_value(value)


def json_value(value: object) -> str:
    """A JSON value as it reads in a message, cut short: null, "30", [0, -4], a list."""
    text = json.dumps(value)
    if len(text) <= 40:
        return text
    return json_kind(value) if isinstance(value, list | dict) else text[:37] + "..."


def _read_weight_map(folder: Path) -> dict[str, str]:
    index = read_json_object(folder, INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = "nothing" if weight_map is None else json_kind(weight_map)
        raise CheckpointError(f"{INDEX_NAME}: weight_map must be a non-empty object, got {got}")
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str):
            raise CheckpointError(
                f"{INDEX_NAME}: weight_map[{name}] must be a file name, got {json_value(file_name)}"
            )
        if not file_name or any(bad in file_name for bad in ("/", "\\", "..", "\0")):
            raise CheckpointError(
                f"{INDEX_NAME}: weight_map[{name}] names {json_value(file_name)}, which is not a "
                "file name in the checkpoint folder"
            )
    return weight_map


def _entries(file_name: str, header: dict[str, Any], data_bytes: int) -> dict[str, TensorEntry]:
    """Check every tensor's dtype, shape and data_offsets; the data must tile data_bytes."""
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file_name}: the header's __metadata__ must map names to strings")
    entries: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        where = f"{file_name}: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} must be described by an object, got {json_kind(info)}")
        dtype = info.get("dtype")
        if not isinstance(dtype, str) or dtype not in ACCEPTED_DTYPES:
            accepted = ", ".join(sorted(ACCEPTED_DTYPES))
            raise CheckpointError(f"{where} has dtype {json_value(dtype)}; accepted: {accepted}")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise CheckpointError(
                f"{where} has shape {json_value(shape)}; expected a list of non-negative integers"
            )
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(n) for n in offsets)
            or not offsets[0] <= offsets[1] <= data_bytes
        ):
            raise CheckpointError(
                f"{where} has data_offsets {json_value(offsets)}; expected [begin, end] within "
                f"the {data_bytes} bytes of data"
            )
        numel = 1
        for n in shape:
            numel *= n
        begin, end = offsets
        if end - begin != numel * ACCEPTED_DTYPES[dtype]:
            raise CheckpointError(
                f"{where} has {end - begin} bytes of data; its dtype and shape need "
                f"{numel * ACCEPTED_DTYPES[dtype]}"
            )
        entries[name] = TensorEntry(file_name, dtype, tuple(shape))
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CheckpointError(
                f"{file_name}: tensor {name}'s data starts at byte {begin}, expected {position} "
                "(tensors must not overlap or leave gaps)"
            )
        position = end
    if position != data_bytes:
        raise CheckpointError(
            f"{file_name}: the tensors cover {position} of the {data_bytes} bytes of data"
        )
    return entries


def _is_count(value: object) -> bool:
    """A non-negative int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
