"""A random-weight model of a real shape, saved as a Hugging Face folder: what the GPU
benchmarks load when the real checkpoint cannot travel (a step's speed does not depend on the
weights' values).

    python bench/random_model.py llama-8b /tmp/models/llama-8b      # bf16, seed 0, CUDA if any
    python bench/random_model.py smollm2 /tmp/models/smollm2 --device cpu

Shapes (from the models' own config.json files):

    name      model                  layers hidden intermediate heads kv_heads vocab   tied
    smollm2   SmolLM2-135M           30     576    1536         9     3        49152   yes
    llama-1b  Llama-3.2-1B           16     2048   8192         32    8        128256  yes
    llama-8b  Llama-3.1-8B           32     4096   14336        32    8        128256  no

The weights are transformers' own initialization (normal, std 0.02; norms 1) under
torch.manual_seed(seed), made on `--device` in `--dtype`. The tokenizer is word-level with
exactly vocab_size tokens ("<|endoftext|>", "<|im_start|>", "<|im_end|>", then "t3", "t4",
...): every id the model can emit decodes. A folder whose config.json already describes the
shape is kept (the line says `reused`). Prints one line:

    random_model shape=<name> folder=<path> params=<n> bytes=<n> seconds=<s> reused=<bool>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE |= {"original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "llama-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "llama-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
}  # fmt: skip


def word_level_tokenizer(vocab_size: int) -> Any:
    """A fast tokenizer of exactly vocab_size tokens with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIAL_TOKENS, *(f"t{i}" for i in range(len(SPECIAL_TOKENS), vocab_size))]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=names[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + "
        "' <|im_end|> ' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant ' }}{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0],
        unk_token=SPECIAL_TOKENS[0],
        chat_template=template,
        model_max_length=131072,
    )


def config_of(shape: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape])


def is_built(folder: Path, shape: str) -> bool:
    config = folder / "config.json"
    if not (config.is_file() and (folder / "tokenizer.json").is_file()):
        return False
    saved = json.loads(config.read_text())
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    sizes += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    has_weights = any(folder.glob("*.safetensors"))
    return has_weights and all(saved.get(k) == SHAPES[shape][k] for k in sizes)


def build(shape: str, folder: Path, dtype: torch.dtype, device: str, seed: int) -> int:
    """Write the folder; returns the number of parameters."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config_of(shape), dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    word_level_tokenizer(SHAPES[shape]["vocab_size"]).save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    reused = is_built(args.folder, args.shape)
    params = (
        0
        if reused
        else build(args.shape, args.folder, getattr(torch, args.dtype), args.device, args.seed)
    )
    size = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    print(
        f"random_model shape={args.shape} folder={args.folder} params={params} bytes={size} "
        f"seconds={time.perf_counter() - began:.1f} reused={reused}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
