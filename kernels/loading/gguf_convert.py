"""Convert a llama.cpp GGUF file (architecture llama) into an HF-style folder, once.

The converted folder is an ordinary Hugging Face checkpoint, so everything downstream (our loader,
and transformers itself in tests) reads it like any other:

    <cache_dir>/<gguf stem>-<conversion key>/
        config.json              LlamaConfig keys, transformers 4 spelling (rope_theta etc.)
        generation_config.json   bos / eos / pad ids from the GGUF tokenizer metadata
        model.safetensors        every tensor dequantized to float32 under its HF name, with
                                 attn_q / attn_k rows un-permuted back from llama.cpp's RoPE layout
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
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch

if TYPE_CHECKING:
    from tqdm import tqdm

# gguf.GGUFReader. The gguf package is imported by name at run time, never statically: its
# vocab module imports transformers, and mypy run from the repo root would follow transformers'
# optional `import kernels` into shoal's own kernels/ package.
GGUFReader: TypeAlias = Any

# Bump when the converted output changes, so old cache folders are not reused.
CONVERTER_VERSION = 1
MARKER_NAME = "shoal-converted.json"
SUPPORTED_ARCHITECTURES = ("llama",)
_STALE_TMP_AGE_S = 3600.0

# GGUF tensor-name suffix inside blk.N -> HF name suffix inside model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


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
    from tqdm import tqdm

    gguf = importlib.import_module("gguf")

    with tqdm(
        total=3, desc=f"converting {gguf_path.name}", unit="step", disable=not progress
    ) as bar:
        bar.set_postfix_str("reading GGUF")
        reader = gguf.GGUFReader(gguf_path)
        config = gguf_hf_config(reader)
        bar.update()
        bar.total = 3 + len(reader.tensors)
        bar.set_postfix_str("dequantizing")
        weights = gguf_weights(reader, config, bar)
        bar.set_postfix_str("writing safetensors")
        from safetensors.torch import save_file

        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del weights
        bar.update()
        bar.set_postfix_str("tokenizer")
        _write_json(folder / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(folder / "generation_config.json", generation)
        _write_tokenizer(gguf_path, folder, model_max_length=config["max_position_embeddings"])
        bar.update()


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The HF config.json dict a GGUF file's metadata describes (LlamaConfig keys)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF file carries rope_freqs (llama3-style RoPE scaling), which this converter "
            "cannot turn back into rope_scaling; load the original HF folder instead"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rope_dims} != head dim {head_dim}")

    vocab_size = meta("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else None
    if vocab_size is None:
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embed.shape[-1])

    eos = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := _field(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    eos = list(dict.fromkeys(eos))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(meta("rope.scaling.type"), meta("rope.scaling.factor")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": None if pad is None else int(pad),
    }


def _gguf_rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none or linear)")


def gguf_weights(
    reader: GGUFReader, config: dict[str, Any], bar: tqdm | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under its HF name, with Q/K rows un-permuted."""
    dequantize = importlib.import_module("gguf.quants").dequantize

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no HF counterpart we know")
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = array.copy()  # F32 tensors come back as read-only views of the file
        weight = torch.from_numpy(array)
        if ".self_attn.q_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        weights[name] = weight
        if bar is not None:
            bar.update()
    return weights


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight; None for names we do not know."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k projection rows (weights or biases).

    llama.cpp's convert_hf_to_gguf.py reorders each head's rows from HF's "rotate half" layout
    (first half of the head dim, then second half) to interleaved pairs:
    `w.reshape(heads, 2, half, ...).swapaxes(1, 2)`. This is its inverse, exactly as in
    transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    permuted = weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
    return permuted.reshape(weight.shape).contiguous()


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


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value, or `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    part = field.parts[field.data[0]]
    value_type = importlib.import_module("gguf").GGUFValueType
    if field.types[0] == value_type.STRING:
        return bytes(part).decode("utf-8")
    if field.types[0] == value_type.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array, expected a single value")
    if field.types[0] == value_type.FLOAT32:
        # The shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(part[0])))
    return part[0].item()


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
