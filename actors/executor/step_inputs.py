"""A launch's inputs on the device, from its decode columns and prompt chunks, in one
host-to-device copy.

The batch's order is the Launch's: its decodes first (one token each, at `decode_starts[i]` of
row `decode_rows[i]`, its input the row's last sampled token, read on the device), then its
prompt chunks. A launch of decodes alone (the steady step) costs a few array operations
whatever its size: its rows and positions are one int64 array, its inputs a gather of
`last_token`, its sampling index a view of a fixed `arange`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from shoal.actors.executor_messages import Launch
from shoal.kernels.batch import BatchShape
from shoal.kernels.device_copy import array_to_device


@dataclass(frozen=True, slots=True)
class StepInputs:
    ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    sample_index: torch.Tensor  # int64 [S]: which of the T tokens sample
    sample_rows: torch.Tensor  # int64 [S]: ... and for which row
    sample_rows_host: np.ndarray  # int64 [S]: the same on the host
    shape: BatchShape


def step_inputs(launch: Launch, last_token: torch.Tensor, counting: torch.Tensor) -> StepInputs:
    """The launch's inputs on last_token's device; `counting` is arange(n) there, n at least
    the number of rows (a batch decodes each row at most once)."""
    if launch.seqs:
        return _mixed_inputs(launch, last_token, counting)
    rows, starts = launch.decode_rows, launch.decode_starts
    n = len(rows)
    host = np.fromiter(itertools.chain(rows, starts), dtype=np.int64, count=2 * n)
    packed = array_to_device(host, last_token.device)
    sample_rows = packed[:n]
    ids = last_token.index_select(0, sample_rows)
    shape = BatchShape(rows, starts, (1,) * n)
    return StepInputs(ids, packed[n:], counting[:n], sample_rows, host[:n], shape)


def _mixed_inputs(launch: Launch, last_token: torch.Tensor, counting: torch.Tensor) -> StepInputs:
    """Decodes and prompt chunks: the chunks' tokens, positions and sampling places listed on
    the host, still one copy. (A chunk without input_ids, a decode in SeqChunk form, takes its
    row's last token as the decode columns do.)"""
    num_decodes = len(launch.decode_rows)
    ids: list[int] = []
    positions: list[int] = []
    sample_index: list[int] = []
    sample_rows: list[int] = []
    fill_at: list[int] = []  # places in the whole batch of SeqChunk decodes ...
    fill_rows: list[int] = []  # ... and their rows
    for seq in launch.seqs:
        if seq.input_ids is None:
            fill_at.append(num_decodes + len(ids))
            fill_rows.append(seq.row)
            ids.append(0)
        else:
            ids.extend(seq.input_ids)
        positions.extend(range(seq.start, seq.start + seq.num_tokens))
        if seq.sample:
            sample_index.append(num_decodes + len(ids) - 1)
            sample_rows.append(seq.row)
    fields = (
        launch.decode_rows,
        launch.decode_starts,
        ids,
        positions,
        sample_index,
        sample_rows,
        fill_at,
        fill_rows,
    )
    host = np.fromiter(itertools.chain.from_iterable(fields), dtype=np.int64)
    packed = array_to_device(host, last_token.device)
    parts = packed.split_with_sizes([len(f) for f in fields])
    decode_rows, decode_starts, chunk_ids, chunk_positions, chunk_index, chunk_rows = parts[:6]
    all_ids = torch.cat((last_token.index_select(0, decode_rows), chunk_ids))
    if fill_at:
        all_ids[parts[6]] = last_token.index_select(0, parts[7])
    rows_end = len(host) - len(fill_at) - len(fill_rows)
    rows_host = np.concatenate((host[:num_decodes], host[rows_end - len(sample_rows) : rows_end]))
    return StepInputs(
        all_ids,
        torch.cat((decode_starts, chunk_positions)),
        torch.cat((counting[:num_decodes], chunk_index)),
        torch.cat((decode_rows, chunk_rows)),
        rows_host,
        _shape(launch),
    )


def token_rows(shape: BatchShape, device: torch.device) -> torch.Tensor:
    """Each entry's row on the device, in batch order (int64 [T]): what a decode graph reads
    for a batch whose entries are not one a sampling row (speculating decodes)."""
    return array_to_device(np.asarray(shape.rows, dtype=np.int64), device)


def _shape(launch: Launch) -> BatchShape:
    """The batch as attention sees it. A speculating decode (SeqChunk.num_drafts) is one
    decode per position, each on the same row and seeing the keys up to its own: attention
    stores every new key before any query reads (kernels/batch.py), so each reads its
    row's earlier drafts as a chunk would, through the decode kernels."""
    rows, starts = list(launch.decode_rows), list(launch.decode_starts)
    lengths = [1] * len(rows)
    drafts = 0
    for seq in launch.seqs:
        if seq.num_drafts:
            drafts += seq.num_drafts
            rows += [seq.row] * seq.num_tokens
            starts += range(seq.start, seq.start + seq.num_tokens)
            lengths += [1] * seq.num_tokens
        else:
            rows.append(seq.row)
            starts.append(seq.start)
            lengths.append(seq.num_tokens)
    return BatchShape(tuple(rows), tuple(starts), tuple(lengths), drafts)
