"""The tokenizer actor's way in: a request's prompt into token ids, checked, and its
admission to the scheduler (docs/architecture.md, "Tokenizer: the front desk").

    ids = intake.prompt(gen)                  # encode (encode.py) and check, or raise
    scheduler.put(intake.admission(gen, ids)) # seeded: an unseeded request gets a seed here

A session turn's prompt is its session's (SessionBook.prompt: the history plus the turn),
checked by the same `check`.
"""

from __future__ import annotations

import random
from typing import Any

from shoal.actors.messages import Admit, Generate
from shoal.actors.tokenizer.encode import check_prompt, encode_prompt
from shoal.actors.tokenizer.sessions import SessionState


class Intake:
    def __init__(
        self, tokenizer: Any, vocab_size: int, context_length: int, seed: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.rng = random.Random(seed)  # the seeds of unseeded requests, reproducible

    def prompt(self, gen: Generate) -> list[int]:
        """The request's prompt as ids (its text, chat messages or input_ids), checked:
        RequestError (a ValueError) naming what is wrong."""
        ids = encode_prompt(self.tokenizer, gen.text, gen.input_ids, gen.messages)
        self.check(ids, gen.sampling.max_new_tokens)
        return ids

    def check(self, ids: list[int], max_new_tokens: int) -> None:
        """Not empty, inside the vocabulary, and room in the context for max_new_tokens."""
        check_prompt(ids, max_new_tokens, self.vocab_size, self.context_length)

    def admission(
        self, gen: Generate, ids: list[int], session: SessionState | None = None
    ) -> Admit:
        """The scheduler's Admit for a checked prompt, with its seed."""
        sampling = gen.sampling
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        if session is None:
            return Admit(gen.rid, tuple(ids), sampling, seed, bootstrap=gen.bootstrap)
        return Admit(gen.rid, tuple(ids), sampling, seed, session.session_id, len(session.tokens))
