"""RoPE tables against transformers 5's rotary embedding modules, bit for bit.

Each case is one config.json dict: shoal reads it (read_rope / read_layer_ropes) and builds
rope_tables; transformers builds the model's config class from the same dict and its
RotaryEmbedding module gives cos and sin for positions 0..N-1. Both run on the CPU in float32,
so every type is compared with torch.equal. Then the reader's refusals and the dynamic cap.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from shoal.kernels.rope import (
    apply_rope,
    partial_rotary_dim,
    rope_context_limit,
    rope_tables,
)
from shoal.loading.checkpoint import CONFIG_NAME, CheckpointError
from shoal.loading.fields import ConfigFields
from shoal.loading.rope_config import (
    read_layer_ropes,
    read_partial_rotary,
    read_rope,
)

CLASSES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen3": (Qwen3Config, Qwen3RotaryEmbedding),
    "phi3": (Phi3Config, Phi3RotaryEmbedding),
}


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    """transformers warns about odd-but-valid rope fields (factor vs context ratio etc.)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _config(model_type: str = "llama", **fields: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 512,
        "num_attention_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 4096,
    }
    d.update(fields)
    return d


def _fields(d: dict[str, Any]) -> ConfigFields:
    return ConfigFields(d, CONFIG_NAME)


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _hf_tables(
    d: dict[str, Any], positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions 0..positions-1 of one sequence: [positions, R]."""
    if d["model_type"] == "gemma3_text":
        config = Gemma3TextConfig.from_dict(d)
        rotary = Gemma3RotaryEmbedding(config)
        x = torch.zeros(1, dtype=torch.float32)
        cos, sin = rotary(x, torch.arange(positions)[None], layer_type)
    else:
        config_class, rotary_class = CLASSES[d["model_type"]]
        rotary = rotary_class(config_class.from_dict(d))
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    return cos[0], sin[0]


def _shoal_tables(
    d: dict[str, Any], positions: int, rotary_dim: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    theta, scaling = read_rope(_fields(d), rotary_dim)
    return rope_tables(rotary_dim, theta, scaling, positions)


def _assert_equal(
    ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]
) -> None:
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert ours[0].shape == theirs[0].shape
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

CASES = {
    "default-t4": _config(rope_theta=500000.0),
    "default-t5": _config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "default-absent": _config(),
    "linear": _config(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=1e4),
    "llama3-t4": _config(rope_theta=500000.0, rope_scaling=LLAMA31, max_position_embeddings=131072),
    "llama3-t5": _config(
        rope_parameters={**LLAMA31, "rope_theta": 500000.0}, max_position_embeddings=131072
    ),
    "llama3-no-original": _config(
        rope_theta=500000.0,
        rope_scaling=_without(LLAMA31, "original_max_position_embeddings"),
    ),
    "yarn-qwen3": _config(
        "qwen3", rope_theta=1e6, rope_scaling=QWEN3_YARN, max_position_embeddings=40960
    ),
    "yarn-qwen3-t5": _config(
        "qwen3",
        rope_parameters={**QWEN3_YARN, "rope_theta": 1e6},
        max_position_embeddings=131072,
    ),
    "yarn-mscale": _config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=163840,
    ),
    "yarn-attention-factor-untruncated": _config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.25,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        max_position_embeddings=131072,
    ),
    "yarn-top-level-original": _config(
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024},
        original_max_position_embeddings=2048,
    ),
    "yarn-original-from-max": _config(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    "dynamic": _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "theta-in-dict-wins": _config(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 7e5}, rope_theta=5.0
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tables_equal_transformers(name: str) -> None:
    d = CASES[name]
    _assert_equal(_shoal_tables(d, 4096), _hf_tables(d, 4096))


def test_llama31_tables_equal_transformers_far_past_the_original_context() -> None:
    d = CASES["llama3-t4"]
    _assert_equal(_shoal_tables(d, 20000), _hf_tables(d, 20000))


def test_dynamic_is_exact_up_to_its_context_limit() -> None:
    d = _config(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=2048)
    theta, scaling = read_rope(_fields(d))
    limit = rope_context_limit(scaling, 2048)
    assert limit == 2048
    _assert_equal(rope_tables(128, theta, scaling, limit), _hf_tables(d, limit))
    # past it transformers rescales every position of the sequence: not one table
    cos, _ = rope_tables(128, theta, scaling, limit + 1)
    assert not torch.equal(cos, _hf_tables(d, limit + 1)[0])


def test_rope_context_limit() -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert rope_context_limit(dynamic, 8192) == 8192
    assert rope_context_limit({**dynamic, "original_max_position_embeddings": 4096}, 8192) == 4096
    assert rope_context_limit({**dynamic, "original_max_position_embeddings": 9000}, 8192) == 8192
    assert rope_context_limit(None, 8192) == 8192
    assert rope_context_limit(dict(LLAMA31), 131072) == 131072
    d = _config(
        rope_scaling={"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}
    )
    assert rope_context_limit(read_rope(_fields(d))[1], 4096) == 1024


def _phi3(rotary_pairs: int, **fields: Any) -> dict[str, Any]:
    """A Phi-3 style longrope config.json: factors in rope_scaling, the original context at the
    top level."""
    gen = torch.Generator().manual_seed(rotary_pairs)
    scaling = {
        "type": "longrope",
        "short_factor": (1 + torch.rand(rotary_pairs, generator=gen) / 10).tolist(),
        "long_factor": (1 + torch.rand(rotary_pairs, generator=gen) * 40).tolist(),
    }
    d = _config("phi3", rope_scaling=scaling, max_position_embeddings=16384)
    d["original_max_position_embeddings"] = 1024
    d.update(fields)
    return d


@pytest.mark.parametrize(
    ("partial", "rotary_dim"), [(None, 128), (0.75, 96)], ids=["phi3", "phi4-mini-partial"]
)
def test_longrope_switches_per_position(partial: float | None, rotary_dim: int) -> None:
    """Rows below original_max_position_embeddings are transformers' short-factor rows (all a
    sequence within the original context sees), rows from it on its long-factor rows (all a
    longer sequence sees)."""
    d = _phi3(rotary_dim // 2)
    if partial is not None:
        d["partial_rotary_factor"] = partial
    fields = _fields(d)
    assert partial_rotary_dim(128, read_partial_rotary(fields)) == rotary_dim
    theta, scaling = read_rope(fields, rotary_dim)
    assert scaling is not None and scaling["factor"] == 16
    ours = rope_tables(rotary_dim, theta, scaling, 3000)
    short = _hf_tables(d, 1024)
    long = _hf_tables(d, 3000)
    for mine, short_rows, long_rows in zip(ours, short, long, strict=True):
        assert torch.equal(mine[:1024], short_rows)
        assert torch.equal(mine[1024:], long_rows[1024:])
        assert not torch.equal(mine[:1024], long_rows[:1024])  # where transformers differs
    attention_factor = math.sqrt(1 + math.log(16) / math.log(1024))
    assert math.isclose(ours[0][0, 0].item(), attention_factor, rel_tol=1e-6)


def test_phi3_default_rope_rotates_the_partial_rotary_dims() -> None:
    d = _config("phi3", partial_rotary_factor=0.75)
    fields = _fields(d)
    rotary_dim = partial_rotary_dim(128, read_partial_rotary(fields))
    theta, scaling = read_rope(fields, rotary_dim)
    _assert_equal(rope_tables(rotary_dim, theta, scaling, 4096), _hf_tables(d, 4096))


def test_longrope_with_explicit_attention_factor_and_su_alias() -> None:
    d = _phi3(64)
    d["rope_scaling"]["type"] = "su"  # transformers 5 wants the original context here too
    d["rope_scaling"]["original_max_position_embeddings"] = 1024
    d["rope_scaling"]["attention_factor"] = 1.5
    theta, scaling = read_rope(_fields(d), 128)
    assert scaling is not None and scaling["rope_type"] == "longrope"
    ours = rope_tables(128, theta, scaling, 2048)
    theirs = _hf_tables(d, 2048)
    assert torch.equal(ours[0][1024:], theirs[0][1024:])
    assert torch.equal(ours[1][1024:], theirs[1][1024:])
    assert ours[0][0, 0].item() == 1.5


def test_phi3_original_context_defaults_to_4096_over_the_dict() -> None:
    """Phi3Config's own original_max_position_embeddings (4096 unless given) wins."""
    d = _phi3(64)
    del d["original_max_position_embeddings"]
    d["rope_scaling"]["original_max_position_embeddings"] = 77
    theta, scaling = read_rope(_fields(d), 128)
    assert scaling is not None and scaling["original_max_position_embeddings"] == 4096
    ours = rope_tables(128, theta, scaling, 4096)
    _assert_equal(ours, _hf_tables(d, 4096))


def _gemma3(**fields: Any) -> dict[str, Any]:
    d = _config("gemma3_text", hidden_size=640, num_attention_heads=4, head_dim=256)
    d.update(fields, max_position_embeddings=32768, num_hidden_layers=6)
    return d


GEMMA3_CASES = {
    "t4": _gemma3(
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=1e4,
    ),
    "t4-defaults": _gemma3(),
    "t5-nested": _gemma3(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    ),
    "t5-nested-partial": _gemma3(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0}}, rope_theta=5e5
    ),
}


@pytest.mark.parametrize("name", list(GEMMA3_CASES))
def test_gemma3_layer_ropes_equal_transformers(name: str) -> None:
    d = GEMMA3_CASES[name]
    ropes = read_layer_ropes(_fields(d), 256)
    for layer_type, (theta, scaling) in ropes.items():
        ours = rope_tables(256, theta, scaling, 4096)
        _assert_equal(ours, _hf_tables(d, 4096, layer_type))


def test_layer_ropes_of_a_config_with_one_rope_are_that_rope() -> None:
    d = CASES["llama3-t4"]
    ropes = read_layer_ropes(_fields(d))
    assert ropes == {
        "full_attention": read_rope(_fields(d)),
        "sliding_attention": read_rope(_fields(d)),
    }
    assert read_layer_ropes(_fields(GEMMA3_CASES["t4-defaults"])) == {
        "full_attention": (1e6, None),
        "sliding_attention": (1e4, None),
    }


def test_read_rope_refuses_ropes_that_differ_by_layer_type() -> None:
    for name in ("t4", "t4-defaults", "t5-nested"):
        with pytest.raises(CheckpointError, match="differs by layer type"):
            read_rope(_fields(GEMMA3_CASES[name]))
    same = {"rope_type": "default", "rope_theta": 3.0}
    nested = _config(rope_parameters={"full_attention": same, "sliding_attention": dict(same)})
    assert read_rope(_fields(nested)) == (3.0, None)


def test_scaling_dict_is_resolved_for_rope_tables() -> None:
    theta, scaling = read_rope(_fields(CASES["yarn-top-level-original"]))
    assert scaling == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}
    theta, scaling = read_rope(_fields(CASES["theta-in-dict-wins"]))
    assert (theta, scaling) == (7e5, {"rope_type": "linear", "factor": 2.0})
    d = _config(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert read_rope(_fields(d)) == (1e4, None)


def test_read_partial_rotary() -> None:
    assert read_partial_rotary(_fields(_config())) == 1.0
    assert read_partial_rotary(_fields(_config(partial_rotary_factor=0.75))) == 0.75
    in_dict = {"rope_type": "default", "partial_rotary_factor": 0.5}
    both = _config(rope_parameters=in_dict, partial_rotary_factor=0.25)
    assert read_partial_rotary(_fields(both)) == 0.5  # the dict's wins, as in transformers
    for bad, where in ((1.5, ""), (0, ""), ("0.5", ""), (2.0, "rope_parameters.")):
        d = _config(partial_rotary_factor=bad)
        if where:
            d = _config(rope_parameters={"rope_type": "default", "partial_rotary_factor": bad})
        with pytest.raises(CheckpointError, match=f"{where}partial_rotary_factor must be"):
            read_partial_rotary(_fields(d))


def test_partial_rotary_dim() -> None:
    assert partial_rotary_dim(128, 0.75) == 96
    assert partial_rotary_dim(80, 0.5) == 40
    with pytest.raises(ValueError, match="positive even"):
        partial_rotary_dim(100, 0.25)  # 25 features: no pairs
    with pytest.raises(ValueError, match="positive even"):
        partial_rotary_dim(10, 0.5)


def test_apply_rope_rotates_only_the_rotary_dims_like_phi3() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 128, generator=gen)
    cos, sin = rope_tables(96, 1e4, None, 5)
    heads_first = q.transpose(0, 1)[None]  # [1, H, T, D]
    theirs, _ = apply_rotary_pos_emb(heads_first, heads_first, cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, sin), theirs[0].transpose(0, 1))


def _yarn(**fields: Any) -> dict[str, Any]:
    return _config(rope_scaling={**QWEN3_YARN, **fields})


def _longrope(**fields: Any) -> dict[str, Any]:
    d = _phi3(64)
    d["rope_scaling"].update(fields)
    return d


REFUSALS = [
    ("unknown-type", _config(rope_parameters={"rope_type": "mrope"}), 'rope_type "mrope" is not'),
    ("type-not-text", _config(rope_scaling={"rope_type": 3}), "rope_type must be a string"),
    ("theta-null", _config(rope_theta=None), "rope_theta must be a positive number, got null"),
    (
        "theta-in-dict",
        _config(rope_parameters={"rope_type": "default", "rope_theta": -1}),
        "rope_parameters.rope_theta must be a positive number",
    ),
    (
        "linear-no-factor",
        _config(rope_scaling={"type": "linear"}),
        "rope_scaling.factor is missing",
    ),
    (
        "dynamic-factor",
        _config(rope_scaling={"type": "dynamic", "factor": 0}),
        "factor must be a positive number",
    ),
    (
        "dynamic-original",
        _config(
            rope_scaling={"type": "dynamic", "factor": 2, "original_max_position_embeddings": 1.5}
        ),
        "original_max_position_embeddings must be a positive integer",
    ),
    (
        "llama3-missing",
        _config(rope_scaling=_without(LLAMA31, "low_freq_factor")),
        "rope_scaling.low_freq_factor is missing",
    ),
    (
        "llama3-equal",
        _config(rope_scaling={**LLAMA31, "high_freq_factor": 1.0}),
        "high_freq_factor must differ",
    ),
    (
        "llama3-original",
        _config(rope_scaling={**LLAMA31, "original_max_position_embeddings": "8192"}),
        "rope_scaling.original_max_position_embeddings must be a positive integer",
    ),
    (
        "top-level-original",
        _config(rope_scaling=LLAMA31, original_max_position_embeddings=0),
        "config.json: original_max_position_embeddings must be a positive integer",
    ),
    ("yarn-factor", _yarn(factor=None), "rope_scaling.factor must be a positive number"),
    ("yarn-beta", _yarn(beta_fast="32"), "beta_fast must be a positive number"),
    ("yarn-attention", _yarn(attention_factor=-1.0), "attention_factor must be a positive"),
    ("yarn-mscale", _yarn(mscale=-1), "mscale must be a non-negative number"),
    ("yarn-truncate", _yarn(truncate="no"), "truncate must be true or false"),
    (
        "yarn-no-max",
        _without(_config(rope_scaling={"type": "yarn", "factor": 2.0}), "max_position_embeddings"),
        "config.json: max_position_embeddings is missing",
    ),
    ("longrope-short-missing", _longrope(short_factor=None), "short_factor must be"),
    ("longrope-long-text", _longrope(long_factor="1,2"), "long_factor must be a non-empty list"),
    ("longrope-zero", _longrope(long_factor=[0.0] * 64), "long_factor must be a non-empty list"),
    ("longrope-length", _longrope(long_factor=[1.0] * 63), "long_factor has 63 entries, not 64"),
    ("longrope-factor", _longrope(factor="4"), "rope_scaling.factor must be a positive number"),
]


@pytest.mark.parametrize(
    ("config", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_reader_refuses(config: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        read_rope(_fields(config), 128)


def test_longrope_refusals_that_need_the_rotary_dim_or_the_context() -> None:
    d = _longrope()
    with pytest.raises(CheckpointError, match="short_factor has 64 entries, not 48"):
        read_rope(_fields(d), 96)
    read_rope(_fields(d))  # without rotary_dim only the two lists' agreement is checked
    del d["rope_scaling"]["short_factor"]
    with pytest.raises(CheckpointError, match=r"rope_scaling\.short_factor is missing"):
        read_rope(_fields(d))
    d = _longrope()
    del d["max_position_embeddings"]
    with pytest.raises(CheckpointError, match="max_position_embeddings is missing"):
        read_rope(_fields(d))  # needed for factor, from which the attention factor comes
    d["rope_scaling"]["attention_factor"] = 1.2
    assert read_rope(_fields(d))[1] is not None


def test_per_layer_partial_rotary_is_refused() -> None:
    d = _gemma3(
        rope_parameters={"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    )
    with pytest.raises(CheckpointError, match=r"full_attention\.partial_rotary_factor must be 1"):
        read_layer_ropes(_fields(d))
