"""GGUF conversion of every model family shoal converts (loading/gguf_config.py).

For each family: a tiny random HF model saved by transformers, written as a GGUF the way
llama.cpp's convert_hf_to_gguf.py would (tests/support/gguf_writer.py), converted back by shoal. The
converted folder must read like the original: config.json parses in transformers with every
field equal (the tiny configs leave what llama.cpp keeps nowhere, like Qwen2's unused
sliding_window or initializer_range, at transformers' defaults, which is what the converted
folder gets), every tensor is bit-equal (F32 GGUF), and transformers' greedy generation gives the
same tokens from both folders.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from safetensors.torch import load_file
from tiny_model import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

from shoal.api.engine import Engine
from shoal.loading.checkpoint import CheckpointError
from shoal.loading.gguf_convert import convert_gguf, hf_name
from shoal.models.load import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MESSAGES = [{"role": "user", "content": "What is a shoal? Answer in 12 words, s'il vous plaît."}]
NEW_TOKENS = 16
VOCAB_SIZE = 512

# Per family: (model_type, config kwargs beyond the shared tiny shape).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama3-rope": (
        "llama",
        {
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_theta": 10000.0,
            },
        },
    ),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {"head_dim": 32}),  # a head dim that is not hidden / heads
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "rope_theta": 10000.0,
            },
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "norm_topk_prob": True,  # what llama.cpp computes (and real Qwen3-MoE use)
            "tie_word_embeddings": False,
        },
    ),
    "gemma2": (
        "gemma2",
        # A window shorter than the prompt, so the sliding layers really slide.
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6},
    ),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,  # layers 0-4 slide, layer 5 is global
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3": (
        "phi3",
        {
            "tie_word_embeddings": False,
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "partial_rotary_factor": 0.5,
                "rope_theta": 10000.0,
                "long_factor": [1.0, 1.5, 2.25, 3.5],
                "short_factor": [1.0, 1.0, 1.25, 1.5],
            },
        },
    ),
}


def make_family_folder(family: str, path: Path, *, seed: int = 0) -> Path:
    """A tiny random model of `family`, saved with tiny_model's tokenizer (see module doc of
    tests/support/tiny_model.py for the weights: seeded, std 0.2, norms near 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    shape: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    config = AutoConfig.for_model(model_type, **(shape | extra))
    model = AutoModelForCausalLM.from_config(config)
    gemma = model_type.startswith("gemma")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = (0.0 if gemma else 1.0) + 0.1 * noise  # Gemma's norm scales by 1 + w
                # llama.cpp stores Gemma norms as w + 1, exact for bf16-born weights (every real
                # Gemma checkpoint) but not for arbitrary float32 ones: make them bf16-born.
                param.copy_(value.to(torch.bfloat16).float() if gemma else value)
            else:
                param.copy_(0.2 * noise)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    make_tiny_tokenizer(VOCAB_SIZE).save_pretrained(path, save_jinja_files=False)
    return path


def config_dict(folder: Path) -> dict[str, Any]:
    """config.json as transformers reads it back (AutoConfig), as a plain dict."""
    from transformers import AutoConfig

    result: dict[str, Any] = AutoConfig.from_pretrained(folder).to_dict()
    return result


def greedy_tokens(folder: Path, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    tokens: list[int] = out[0, len(prompt_ids) :].tolist()
    return tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_round_trips_through_gguf(family: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    original = make_family_folder(family, tmp_path / "hf")
    gguf_path = write_gguf(original, tmp_path / f"{family}.gguf")
    converted = convert_gguf(gguf_path, tmp_path / "converted", progress=False)

    expected_config, got_config = config_dict(original), config_dict(converted)
    for key in ("transformers_version", "_name_or_path"):
        expected_config.pop(key, None)
        got_config.pop(key, None)
    assert got_config == expected_config

    expected, got = (
        load_file(original / "model.safetensors"),
        load_file(converted / "model.safetensors"),
    )
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    tokenizer = AutoTokenizer.from_pretrained(original)
    converted_tokenizer = AutoTokenizer.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    assert converted_tokenizer.encode(prompt) == prompt_ids
    assert len(prompt_ids) > 6  # longer than the Gemma windows
    expected_tokens = greedy_tokens(original, prompt_ids)
    assert greedy_tokens(converted, prompt_ids) == expected_tokens
    # shoal itself, from the .gguf file (converted into its cache dir as at start-up)
    assert asyncio.run(shoal_greedy(gguf_path, tmp_path / "cache", prompt_ids)) == expected_tokens


async def shoal_greedy(gguf_path: Path, cache_dir: Path, prompt_ids: list[int]) -> list[int]:
    loaded = load_model(gguf_path, cache_dir=cache_dir, progress=False)
    # float32: the tokens are held to transformers' (auto takes bfloat16 on a CPU with AMX)
    options = {"page_size": 4, "chunk_size": 5, "seed": 0, "strict_integrity": True}
    async with Engine(loaded, dtype="float32", **options) as engine:
        done = await engine.generate(
            input_ids=prompt_ids, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True
        ).result()
    return list(done.token_ids)


def test_q8_0_experts_dequantize_to_the_quantized_values(tmp_path: Path) -> None:
    """Q8_0 blocks (3-D expert stacks included) come back as gguf's own dequantization of them;
    Q8_0 works on each row's 32-value blocks alone, so a stacked expert quantizes as it would
    on its own."""
    original = make_family_folder("qwen3-moe", tmp_path / "hf")
    gguf_path = write_gguf(original, tmp_path / "q8.gguf", quantize=True)
    converted = convert_gguf(gguf_path, tmp_path / "converted", progress=False)
    expected, got = (
        load_file(original / "model.safetensors"),
        load_file(converted / "model.safetensors"),
    )
    assert sorted(got) == sorted(expected)
    qtype = gguf.GGMLQuantizationType.Q8_0
    quantized = 0
    for name, tensor in expected.items():
        want = tensor
        if tensor.dim() == 2 and tensor.shape[-1] % 32 == 0:
            blocks = gguf.quants.quantize(tensor.numpy(), qtype)
            want = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype)))
            quantized += not torch.equal(want, tensor)
        assert torch.equal(got[name], want), name
    assert quantized > 20  # the experts and projections really went through Q8_0
    assert json.loads((converted / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "starcoder2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as info:
        convert_gguf(path, tmp_path / "converted", progress=False)
    assert str(info.value) == (
        "GGUF architecture 'starcoder2' is not supported; supported: "
        "llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"
    )
    assert not (tmp_path / "converted").exists()


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path: Path) -> None:
    """llama.cpp keeps llama3 RoPE scaling only as rope_freqs; other factors (a Llama 3 with
    unusual low/high_freq_factor, or a hand-made file) cannot be named in an HF config."""
    original = make_family_folder("llama", tmp_path / "hf")
    odd = {"rope_freqs.weight": np.linspace(1.0, 3.0, 16 // 2, dtype=np.float32)}  # head dim 16
    gguf_path = write_gguf(original, tmp_path / "odd.gguf", extra_tensors=odd)
    with pytest.raises(CheckpointError, match="rope_freqs are not llama3 RoPE scaling"):
        convert_gguf(gguf_path, tmp_path / "converted", progress=False)


def test_hf_names_by_architecture() -> None:
    """The names that differ between architectures; the round trips above cover the rest."""
    assert (
        hf_name("blk.1.ffn_norm.weight", "llama")
        == "model.layers.1.post_attention_layernorm.weight"
    )
    assert (
        hf_name("blk.1.ffn_norm.weight", "gemma2")
        == "model.layers.1.pre_feedforward_layernorm.weight"
    )
    assert hf_name("blk.1.post_ffw_norm.weight", "gemma3") == (
        "model.layers.1.post_feedforward_layernorm.weight"
    )
    assert hf_name("blk.0.attn_q_norm.weight", "qwen3") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.0.attn_q_norm.weight", "llama") is None
    assert hf_name("blk.0.ffn_up.weight", "phi3") == "model.layers.0.mlp.gate_up_proj.weight"
    assert hf_name("blk.0.attn_qkv.weight", "phi3") == "model.layers.0.self_attn.qkv_proj.weight"
    assert hf_name("blk.2.ffn_up_exps.weight", "llama") == (
        "model.layers.2.block_sparse_moe.experts.{e}.w3.weight"
    )
    assert hf_name("blk.2.ffn_gate_inp.weight", "qwen3moe") == "model.layers.2.mlp.gate.weight"
    assert hf_name("blk.2.ffn_down_exps.weight", "qwen3moe") == (
        "model.layers.2.mlp.experts.{e}.down_proj.weight"
    )
    assert hf_name("blk.2.ffn_gate.7.weight", "llama") == (
        "model.layers.2.block_sparse_moe.experts.7.w1.weight"  # an early Mixtral file's expert
    )
    assert hf_name("blk.2.ffn_gate.7.weight", "qwen2") is None
    assert hf_name("rope_freqs.weight", "llama") is None
