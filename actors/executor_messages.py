"""The executor's mailbox (actors/executor/executor.py): what the scheduler launches, with the
parts a launch carries (`RowWriteMsg`, a table write, the cache manager's Plan carries too),
and the weight load the tokenizer's write task asks for. Beside actors/messages.py, whose
`Shutdown` it shares."""

from __future__ import annotations

import asyncio

import msgspec

from shoal.actors.messages import Shutdown
from shoal.actors.writer_messages import MemoryTag, WeightSource
from shoal.params import SamplingParams


class RowWriteMsg(msgspec.Struct, frozen=True):
    """Device request-slot table update: table[row, start:start + len(pages)] = pages."""

    row: int
    start: int
    pages: tuple[int, ...]


class RowInit(msgspec.Struct, frozen=True):
    """A request's sampling state, sent with its first chunk (again after a retraction)."""

    sampling: SamplingParams
    seed: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


class SeqChunk(msgspec.Struct, frozen=True):
    """One sequence of a batch: new tokens at positions start .. start + n - 1 of its row.

    input_ids None means a decode step whose input is the row's last sampled token.
    `num_drafts` > 0 makes it a speculating decode (see the field).
    `logprob_targets` asks for prompt logprobs (SamplingParams.logprob_start_len): position
    `logprobs_from + i` of the chunk gives the logprob of the next prompt token,
    logprob_targets[i] (the prompt's last position, which samples, is never among them).
    """

    row: int
    start: int
    num_tokens: int
    input_ids: tuple[int, ...] | None
    sample: bool
    init: RowInit | None = None
    logprob_targets: tuple[int, ...] = ()
    logprobs_from: int = 0
    # A speculating decode (actors/executor/draft_asks.py): input_ids are the row's last token
    # and this many drafts, and its sampled token follows the drafts it keeps
    num_drafts: int = 0


class Launch(msgspec.Struct, frozen=True, tag=True):
    """One batch: its decodes first, as two flat columns (a decode is one token at
    `decode_starts[i]` of row `decode_rows[i]`, its input the row's last sampled token, and it
    samples), then its prompt chunks (`seqs`), in that order on the device."""

    batch_id: int
    writes: tuple[RowWriteMsg, ...]
    seqs: tuple[SeqChunk, ...]
    decode_rows: tuple[int, ...] = ()
    decode_starts: tuple[int, ...] = ()

    def all_seqs(self) -> tuple[SeqChunk, ...]:
        """Every sequence in batch order, a decode as a SeqChunk (for readers that want one
        shape: tests, the slow paths)."""
        decodes = zip(self.decode_rows, self.decode_starts, strict=True)
        return tuple(SeqChunk(row, start, 1, None, True) for row, start in decodes) + self.seqs


class LoadWeights(msgspec.Struct, frozen=True, tag=True):
    """Swap in new weights of the same architecture, a checkpoint's or tensors' (only sent
    while nothing is in flight). The reply raises OperationRefused (invalid_checkpoint,
    invalid_weights) if they were refused (old weights stay)."""

    source: WeightSource
    reply: asyncio.Future[None]


class SetMemory(msgspec.Struct, frozen=True, tag=True):
    """Free the KV pool's or the weights' memory (release True), or allocate and fill them
    again (only sent while nothing is in flight: actors/executor/memory.py)."""

    release: bool
    tags: tuple[MemoryTag, ...]
    reply: asyncio.Future[None]


ExecutorMsg = Launch | LoadWeights | SetMemory | Shutdown
