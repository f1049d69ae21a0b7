"""One request's routed experts (SamplingParams.return_routed_experts) as its batches send
them, placed by position, and cut to SGLang's answer when it finishes.

    rows = RoutedRows(sampling.routed_experts_start_len)   # at admission
    rows.place(output.routed_experts)                       # every ExpertRows, in any order
    rows.answer(num_prompt + num_outputs)                   # int32 bytes, or None

Row p - start holds position p's [num_layers, top_k] ids. A piece never starts past the rows
held (positions come in order: each chunk and decode after the ones before it), and one that
starts inside them overwrites (a retracted request's recomputed positions): never duplicated.
"""

from __future__ import annotations

from shoal.actors.messages import ExpertRows


class RoutedRows:
    def __init__(self, start: int) -> None:
        self.start = start  # routed_experts_start_len: the first position answered
        self.data = bytearray()
        self.row_bytes = 0  # one position's, known from the first piece

    def place(self, piece: ExpertRows) -> None:
        assert piece.count > 0 and len(piece.ids) % piece.count == 0, piece.count
        row_bytes = len(piece.ids) // piece.count
        assert self.row_bytes in (0, row_bytes), (self.row_bytes, row_bytes)
        self.row_bytes = row_bytes
        at = (piece.first - self.start) * row_bytes
        assert 0 <= at <= len(self.data), (piece.first, self.start, len(self.data))
        self.data[at : at + len(piece.ids)] = piece.ids

    def answer(self, num_tokens: int) -> bytes | None:
        """SGLang's rows for a request of `num_tokens` (prompt and output): positions
        start .. num_tokens - 2 (the last token was never an input); None if some never
        came (a request that failed)."""
        num_rows = max(num_tokens - 1 - self.start, 0)
        size = num_rows * self.row_bytes
        if num_rows and (not self.row_bytes or len(self.data) < size):
            return None
        return bytes(self.data[:size])
