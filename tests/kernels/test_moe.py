"""The grouped-matmul MoE layer (kernels/moe.py) matches transformers 5.23's Mixtral and Qwen3-MoE
sparse blocks, under both experts implementations transformers runs on CPU, and the per-expert
checkpoint names fuse into the [gate; up] layout it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from shoal.kernels.moe import Experts

HIDDEN, INTERMEDIATE = 32, 24
Block = MixtralSparseMoeBlock | Qwen3MoeSparseMoeBlock


def make_block(
    family: str, num_experts: int, top_k: int, normalize: bool, seed: int
) -> tuple[PreTrainedConfig, Block]:
    """A transformers sparse block with random weights (std 0.2) in float32, eval mode."""
    config: PreTrainedConfig
    block: Block
    if family == "mixtral":
        config = MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTERMEDIATE,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=normalize,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return config, block.eval()


def block_tensors(block: Block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Owned copies of (router [E, H], gate_up [E, 2I, H], down [E, H, I])."""
    experts = block.experts
    return (
        block.gate.weight.detach().clone(),
        experts.gate_up_proj.detach().clone(),
        experts.down_proj.detach().clone(),
    )


def experts_of(block: Block, family: str, top_k: int, normalize: bool) -> Experts:
    return Experts(
        *block_tensors(block),
        top_k,
        normalize or family == "mixtral",
        float32_weights=family == "mixtral",
    )


def hf_forward(block: Block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x.unsqueeze(0)).squeeze(0)


def assert_float32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A few float32 ulps: CPU matmuls give last-bit differences for the same row in blocks of
    another height or at another position, so no grouping can promise transformers' bits."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def fraction_equal(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual == expected).float().mean().item()


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize(("family", "normalize"), CASES)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
@pytest.mark.parametrize("top_k", [2, 3])
def test_matches_the_transformers_block_in_float32(
    family: str, normalize: bool, implementation: str, num_tokens: int, top_k: int
) -> None:
    """Within float32's last bits of both (the summation order of each token's k terms is the
    eager loop's, and grouped_mm's when k = 2; the matmuls' rows are blocked differently)."""
    config, block = make_block(family, 8, top_k, normalize, seed=num_tokens + top_k)
    config._experts_implementation = implementation
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = experts_of(block, family, top_k, normalize)(x)
    expected = hf_forward(block, x)
    assert_float32_close(out, expected)


@pytest.mark.parametrize(("family", "normalize"), CASES)
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_matches_grouped_mm_in_bfloat16(family: str, normalize: bool, num_tokens: int) -> None:
    """transformers' CPU default, with the routing weights in each family's dtype (float32 for
    Mixtral, bfloat16 for Qwen3-MoE): the same bits but where a last-bit matmul difference
    tips a bfloat16 rounding (none on the machine this was written on)."""
    config, block = make_block(family, 8, 2, normalize, seed=num_tokens)
    config._experts_implementation = "grouped_mm"
    block = block.to(torch.bfloat16)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    x = x.to(torch.bfloat16)
    out, expected = experts_of(block, family, 2, normalize)(x), hf_forward(block, x)
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-5)
    assert fraction_equal(out, expected) > 0.99


def test_mixtral_weighs_the_experts_in_float32() -> None:
    """Casting Mixtral's routing weights to bfloat16 changes the last bit of many outputs."""
    config, block = make_block("mixtral", 8, 2, True, seed=0)
    config._experts_implementation = "grouped_mm"
    block = block.to(torch.bfloat16)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cast = Experts(*block_tensors(block), 2, True, float32_weights=False)
    assert fraction_equal(cast(x), hf_forward(block, x)) < 0.9


@pytest.mark.parametrize(("family", "normalize"), CASES)
def test_top_k_equal_to_the_number_of_experts(family: str, normalize: bool) -> None:
    """Every token through every expert (with normalize, the weights are the full softmax)."""
    config, block = make_block(family, 4, 4, normalize, seed=5)
    config._experts_implementation = "eager"
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    assert_float32_close(experts_of(block, family, 4, normalize)(x), hf_forward(block, x))


def test_an_expert_no_token_picks_is_never_run() -> None:
    """A decode step runs only its token's top_k experts: NaN in every other expert's weights
    cannot reach the output (a dense pass would give NaN * 0 = NaN)."""
    _, block = make_block("qwen3_moe", 8, 2, True, seed=6)
    experts = experts_of(block, "qwen3_moe", 2, True)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5))
    expected = experts(x)
    _, picked = experts.route(x)
    unpicked = [e for e in range(8) if e not in picked[0].tolist()]
    experts.gate_up[unpicked] = float("nan")
    experts.down[unpicked] = float("nan")
    assert torch.equal(experts(x), expected)


def test_no_tokens_give_no_rows() -> None:
    _, block = make_block("mixtral", 8, 2, True, seed=7)
    assert experts_of(block, "mixtral", 2, True)(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_load_replaces_the_weights_and_never_keeps_the_callers() -> None:
    _, first = make_block("qwen3_moe", 8, 2, True, seed=8)
    _, second = make_block("qwen3_moe", 8, 2, True, seed=9)
    experts = experts_of(first, "qwen3_moe", 2, True)
    held = [t.data_ptr() for t in experts.tensors()]
    update = block_tensors(second)
    experts.load(*update)
    assert [t.data_ptr() for t in experts.tensors()] == held
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(6))
    out = experts(x)
    assert_float32_close(out, hf_forward(second, x))
    for tensor in update:
        tensor.mul_(3.0)
    assert torch.equal(experts(x), out)


def test_load_refuses_another_shape() -> None:
    _, block = make_block("mixtral", 8, 2, True, seed=10)
    experts = experts_of(block, "mixtral", 2, True)
    router, gate_up, down = block_tensors(block)
    with pytest.raises(AssertionError):
        experts.load(router, gate_up[:, :INTERMEDIATE], down)


def test_tensors_come_in_a_fixed_order() -> None:
    _, block = make_block("mixtral", 8, 2, True, seed=11)
    router, gate_up, down = block_tensors(block)
    experts = Experts(router, gate_up, down, 2, True)
    assert [t.data_ptr() for t in experts.tensors()] == [
        router.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
    ]


@pytest.mark.parametrize(
    ("family", "prefix", "gate", "up", "down"),
    [
        ("mixtral", "model.layers.{}.block_sparse_moe", "w1", "w3", "w2"),
        ("qwen3_moe", "model.layers.{}.mlp", "gate_proj", "up_proj", "down_proj"),
    ],
)
def test_saved_checkpoints_name_each_expert_and_fuse_gate_first(
    tmp_path: Path, family: str, prefix: str, gate: str, up: str, down: str
) -> None:
    """save_pretrained writes per-expert [I, H] / [H, I] matrices and a router named `gate`;
    stacking them as [gate; up] along the rows gives the module's experts.gate_up_proj."""
    model: MixtralForCausalLM | Qwen3MoeForCausalLM
    small = dict(
        vocab_size=32,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        model = MixtralForCausalLM(
            MixtralConfig(**small, intermediate_size=INTERMEDIATE, num_local_experts=4)
        )
    else:
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**small, head_dim=16, moe_intermediate_size=INTERMEDIATE, num_experts=4)
        )
    model.save_pretrained(tmp_path)
    module = model.model.layers[1].mlp
    layer = prefix.format(1)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
        expert = [f"{layer}.experts.{e}" for e in range(4)]
        gate_up = torch.stack(
            [
                torch.cat(
                    [saved.get_tensor(f"{n}.{gate}.weight"), saved.get_tensor(f"{n}.{up}.weight")]
                )
                for n in expert
            ]
        )
        down_proj = torch.stack([saved.get_tensor(f"{n}.{down}.weight") for n in expert])
        assert torch.equal(saved.get_tensor(f"{layer}.gate.weight"), module.gate.weight)
    assert torch.equal(gate_up, module.experts.gate_up_proj)
    assert torch.equal(down_proj, module.experts.down_proj)
    assert not any("gate_up_proj" in name for name in names)
