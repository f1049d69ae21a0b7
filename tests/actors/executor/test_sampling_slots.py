"""actors/executor/sampling_slots.py, table_writes.py and step_inputs.py: what a launch reads
without per-row Python. The slots' draw equals `sample`'s over the rows' views (so a row draws
the same tokens on the one-stage path and the pipeline's), a restarted row keeps nothing of its
row's previous request, table writes keep their order, and a mixed launch's inputs are laid
out as its SeqChunks say."""

from __future__ import annotations

import numpy as np
import torch

from shoal.actors.executor.sampling_slots import RowStart, SamplingSlots
from shoal.actors.executor.step_inputs import step_inputs
from shoal.actors.executor.table_writes import write_tables
from shoal.actors.executor_messages import Launch, RowWriteMsg, SeqChunk
from shoal.kernels.sampling import SamplingRow, sample
from shoal.params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 200

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(temperature=1.1, top_k=12),
    SamplingParams(temperature=0.6, min_p=0.1, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.0),
]


def draw(slots: SamplingSlots, logits: torch.Tensor, rows: list[int]) -> list[int]:
    rows_host = np.array(rows, dtype=np.int64)
    tokens = slots.sample(logits, torch.from_numpy(rows_host), rows_host)
    slots.advance(torch.from_numpy(rows_host))
    return tokens.tolist()


def test_the_slots_draw_what_sample_draws_from_the_rows_views() -> None:
    slots = SamplingSlots(16, VOCAB, CPU)
    rows = [9, 2, 14, 5, 0]
    seeds = [70 + i for i in range(len(rows))]
    already = [0, 3, 0, 1, 7]  # tokens sampled before: a retracted row restarts at its count
    slots.start(
        [
            RowStart(row, params, seed, n, False)
            for row, params, seed, n in zip(rows, PARAMS, seeds, already, strict=True)
        ]
    )
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
        views = [
            SamplingRow(params, seed, (), (), n + step)
            for params, seed, n in zip(PARAMS, seeds, already, strict=True)
        ]
        assert draw(slots, logits, rows) == sample(logits, views).tolist(), step


def test_a_restarted_row_keeps_nothing_of_its_previous_request() -> None:
    """Row 3 served a sampled request for a few steps; a greedy request that takes the row
    draws the argmax, and a sampled one draws what it draws on a fresh row, from its step 0."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    fresh = SamplingSlots(8, VOCAB, CPU)
    fresh.start([RowStart(6, PARAMS[2], 11, 0, False)])
    expected = [draw(fresh, logits, [6])[0] for _ in range(4)]

    slots = SamplingSlots(8, VOCAB, CPU)
    slots.start(
        [RowStart(3, SamplingParams(temperature=1.5, top_p=0.5, logprobs=True), 9, 0, True)]
    )
    for _ in range(5):
        draw(slots, logits, [3])
    slots.start([RowStart(3, SamplingParams(temperature=0.0), 9, 0, False)])
    rows = np.array([3])
    assert draw(slots, logits, [3]) == logits.argmax(-1).tolist()
    assert slots.tracked_at(rows) == [] and slots.logprobs_at(rows) == []
    slots.start([RowStart(3, PARAMS[2], 11, 0, False)])
    assert [draw(slots, logits, [3])[0] for _ in range(4)] == expected


def test_table_writes_apply_in_order_to_every_table() -> None:
    tables = [torch.zeros(4, 6, dtype=torch.int64) for _ in range(2)]
    writes = (
        RowWriteMsg(1, 0, (7, 8, 9)),
        RowWriteMsg(2, 4, (5,)),
        RowWriteMsg(1, 2, (30, 31)),  # over the first write's last page: the later one wins
        RowWriteMsg(3, 0, ()),
    )
    write_tables(tables, writes)
    expected = torch.zeros(4, 6, dtype=torch.int64)
    expected[1, :4] = torch.tensor([7, 8, 30, 31])
    expected[2, 4] = 5
    for table in tables:
        assert torch.equal(table, expected)


def test_a_mixed_launch_lays_out_decodes_then_chunks() -> None:
    last_token = torch.arange(100, 110)
    chunks = (
        SeqChunk(4, 0, 3, (11, 12, 13), False),
        SeqChunk(6, 2, 2, (21, 22), True),
        SeqChunk(8, 5, 1, None, True),  # a decode in SeqChunk form
    )
    launch = Launch(0, (), chunks, decode_rows=(1, 7), decode_starts=(9, 4))
    step = step_inputs(launch, last_token, torch.arange(10))
    assert step.ids.tolist() == [101, 107, 11, 12, 13, 21, 22, 108]
    assert step.positions.tolist() == [9, 4, 0, 1, 2, 2, 3, 5]
    assert step.sample_index.tolist() == [0, 1, 6, 7]
    assert step.sample_rows.tolist() == step.sample_rows_host.tolist() == [1, 7, 6, 8]
    assert step.shape.rows == (1, 7, 4, 6, 8)
    assert step.shape.prefix_lens == (9, 4, 0, 2, 5)
    assert step.shape.extend_lens == (1, 1, 3, 2, 1)

    decodes = step_inputs(Launch(1, (), (), (3, 0), (12, 30)), last_token, torch.arange(10))
    assert decodes.ids.tolist() == [103, 100] and decodes.positions.tolist() == [12, 30]
    assert decodes.sample_index.tolist() == [0, 1] and decodes.sample_rows_host.tolist() == [3, 0]
    assert decodes.shape.extend_lens == (1, 1)
