"""The decode-graph path's static buffers and padding, checked on CPU and, with a device, on
CUDA with the graphs captured.

On CPU, `DecodeGraphs` without `capture` has the same buffers and padding as captured CUDA
graphs but runs the forward instead of replaying; the Triton kernels run under the
interpreter. On CUDA the graphs are captured and replayed.
Four sequences decode together, then one stops and three replay the size-4 graph: the
padding entry, stale from the stopped sequence, must neither write KV nor disturb the others.
Tokens must equal the eager Triton path's, and the whole KV pool too, up to rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from shoal.actors.executor.cuda_graphs import DecodeGraphs, capture_sizes
from shoal.actors.executor.device_state import DeviceState
from shoal.actors.executor_messages import Launch, RowInit, RowWriteMsg, SeqChunk
from shoal.kernels.triton.attention import TritonAttention
from shoal.models.kv_pool import KVPool
from shoal.models.llama import LLAMA
from shoal.models.load import LoadedModel
from shoal.params import SamplingParams

PAGE_SIZE = 4
ROWS = (5, 1, 6, 2)
PROMPTS = ((3, 17, 22, 9, 41), (7, 8), (100, 3, 5, 66, 12, 13, 14, 15, 99), (4, 4, 4))
FOURTH_STOPS_AFTER = 2  # decode steps


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_state(tiny_model: LoadedModel, graphs: bool, max_batch: int = 4) -> DeviceState:
    config = tiny_model.config
    model = LLAMA.build(config, tiny_model.weights, torch.float32, DEVICE)
    pool = KVPool(config, 64 * PAGE_SIZE, torch.float32, DEVICE)
    attention = TritonAttention(PAGE_SIZE, config.num_kv_heads)
    state = DeviceState(model, pool, attention, 8, 16, PAGE_SIZE, config.eos_token_ids)
    if graphs and DEVICE.type == "cuda":
        state.capture_graphs(max_batch, 64)
        assert state.graphs is not None
        assert sorted(state.graphs.graphs) == capture_sizes(max_batch)
    elif graphs:  # no capture
        state.graphs = DecodeGraphs(model, pool, state.page_table, PAGE_SIZE, max_batch, 64)
    return state


def prefill(state: DeviceState) -> tuple[int, ...]:
    """Prefill the prompts (all pages written up front); their first tokens."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    writes = tuple(
        RowWriteMsg(row, 0, tuple(range(10 * i, 10 * i + 8))) for i, row in enumerate(ROWS)
    )
    chunks = tuple(
        SeqChunk(row, 0, len(p), p, True, RowInit(greedy, 0, p, ()))
        for row, p in zip(ROWS, PROMPTS, strict=True)
    )
    return state.launch(Launch(0, writes, chunks)).result()[0]


def steps(state: DeviceState, num_decode_steps: int) -> list[tuple[int, ...]]:
    """Prefill the prompts, then decode them together."""
    tokens = [prefill(state)]
    for step in range(num_decode_steps):
        live = len(ROWS) if step < FOURTH_STOPS_AFTER else len(ROWS) - 1
        rows = tuple(ROWS[:live])
        starts = tuple(len(p) + step for p in PROMPTS[:live])
        launch = Launch(step + 1, (), (), decode_rows=rows, decode_starts=starts)
        tokens.append(state.launch(launch).result()[0])
    return tokens


def test_padded_graph_decode_matches_eager_decode(tiny_model: LoadedModel) -> None:
    plain = device_state(tiny_model, graphs=False)
    padded = device_state(tiny_model, graphs=True)
    assert padded.graphs is not None and padded.graphs.size_for(len(ROWS) - 1) == 4
    assert steps(padded, 6) == steps(plain, 6)
    # Equal up to rounding: a matmul over 4 rows rounds a little differently from one over 3.
    for layer in range(tiny_model.config.num_layers):
        torch.testing.assert_close(padded.kv.k[layer], plain.kv.k[layer], rtol=0, atol=1e-4)
        torch.testing.assert_close(padded.kv.v[layer], plain.kv.v[layer], rtol=0, atol=1e-4)


def test_speculating_decodes_replay_a_graph_and_verify_as_eagerly(
    tiny_model: LoadedModel,
) -> None:
    """Issue 35 on the graph path: a speculating decode (its last token and three drafts) is
    four graph entries of its row beside a plain decode; the graph's logits verify the drafts
    as the eager path's do: the two right drafts kept, the wrong third replaced by the token
    one-at-a-time decoding gives there."""
    truth = [step[0] for step in steps(device_state(tiny_model, graphs=False), 3)]
    wrong = (truth[3] + 1) % tiny_model.config.vocab_size
    results = []
    for graphs in (False, True):
        state = device_state(tiny_model, graphs, max_batch=8)
        replays = 0
        if state.graphs is not None:
            run = state.graphs.run

            def counted(*args: torch.Tensor, run: Any = run) -> torch.Tensor:
                nonlocal replays
                replays += 1
                return run(*args)

            state.graphs.run = counted  # type: ignore[method-assign]
        first = prefill(state)
        assert first[0] == truth[0]
        speculating = SeqChunk(
            ROWS[0], len(PROMPTS[0]), 4, (truth[0], truth[1], truth[2], wrong), True, num_drafts=3
        )
        launch = Launch(
            1, (), (speculating,), decode_rows=(ROWS[1],), decode_starts=(len(PROMPTS[1]),)
        )
        result = state.launch(launch).result()
        assert replays == (1 if graphs else 0)
        results.append((result.next_tokens, result.drafted))
    assert results[0] == results[1]
    next_tokens, drafted = results[1]
    assert next_tokens[1] == truth[3] and drafted == ((1, (truth[1], truth[2])),)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
