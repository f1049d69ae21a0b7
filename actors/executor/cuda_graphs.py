"""CUDA graphs of the decode forward: one per captured batch size, replayed with padding.

A decode step of b sequences (one new token each, each sampling) replays the graph of the
smallest captured size B >= b. The graph reads static buffers; a replay first copies the
step's inputs into their first b entries and marks entries b .. B as padding: slot -1 (the
store kernel writes nothing) and length 0 (the decode kernel attends to nothing). Their
logits are garbage and never read. Larger batches and any batch with a prefill run eagerly.

Sizes captured: 1, 2, 4, 8, then every 16 up to the limit. Each graph uses the Triton
attention with a fixed number of decode splits, chosen for the full context length, so a
graph stays valid whatever lengths it later sees.

`DecodeGraphs(...)` alone sets up the same buffers and padding without capturing (each
"replay" then runs the forward): how CPU tests check the padding under the interpreter.
"""

from __future__ import annotations

import bisect

import torch

from shoal.kernels.batch import BatchShape
from shoal.kernels.triton.attention import DecodePart, TritonBatch, decode_splits, slot_mapping_of
from shoal.models.decoder import DecoderModel
from shoal.models.kv_pool import KVPool


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if max_batch > 0 and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv: KVPool,
        page_table: torch.Tensor,
        page_size: int,
        max_batch: int,
        context_length: int,
    ) -> None:
        device = model.device
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]
        num_kv_heads = model.config.num_kv_heads
        self.splits = {b: decode_splits(context_length, b, num_kv_heads) for b in self.sizes}
        self.model = model
        self.kv = kv
        self.page_table = page_table
        self.page_size = page_size
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.rows = torch.zeros(largest, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.token_index = torch.arange(largest, dtype=torch.int32, device=device)
        self.sample_index = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def capture(
        cls,
        model: DecoderModel,
        kv: KVPool,
        page_table: torch.Tensor,
        page_size: int,
        max_batch: int,
        context_length: int,
    ) -> DecodeGraphs:
        """Capture on the current stream (not the default one). Largest first, so the smaller
        graphs reuse its memory pool."""
        graphs = cls(model, kv, page_table, page_size, max_batch, context_length)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.current_stream()
        for size in reversed(graphs.sizes):
            graphs.forward(size)  # compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's calls may break the capture (the completion
            # thread and the event loop keep running)
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                logits = graphs.forward(size)
            graphs.graphs[size] = (graph, logits)
        return graphs

    def forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first `size` entries of the static buffers."""
        splits = self.splits[size]
        decode = DecodePart(self.rows[:size], self.seq_lens[:size], self.token_index[:size], splits)
        batch = TritonBatch(self.page_table, self.page_size, self.slot_mapping[:size], decode, None)
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], batch, self.kv, self.sample_index[:size]
        )

    def fits_tokens(self, shape: BatchShape) -> bool:
        """A batch of one token an entry (a speculating decode is one entry a position:
        step_inputs._shape), no larger than the largest graph; `run` gives every entry's
        logits, whichever sample."""
        num_seqs = len(shape.rows)
        return 0 < num_seqs <= self.sizes[-1] and shape.extend_lens.count(1) == num_seqs

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured size that holds num_seqs."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Replay for a decode batch that `fits` (its tokens' rows on the device, [b]); returns
        its logits [b, V]. The inputs reach the static buffers on the device: no host copy."""
        b = rows.shape[0]
        size = self.size_for(b)
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.rows[:b] = rows
        torch.add(self.positions[:b], 1, out=self.seq_lens[:b])
        self.seq_lens[b:size] = 0
        self.slot_mapping[:b] = slot_mapping_of(self.page_table, rows, positions, self.page_size)
        self.slot_mapping[b:size] = -1
        if size not in self.graphs:  # not captured: run it
            return self.forward(size)[:b]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]
