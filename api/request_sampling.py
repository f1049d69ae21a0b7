"""One request's sampling as Engine.generate is given it, checked once for every door: a
SamplingParams, its fields as keywords over it (api/sampling_wire.py), or both; and
`max_new_tokens=RoomLeft(...)` (params.py), the room the prompt leaves, sized later where the
prompt is measured and validated here at the most it may come to.

    sampling, room = request_sampling(sampling, fields, limits, vocab_size, context_length)
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.api.sampling_wire import sampling_from
from shoal.limits import InputLimits
from shoal.params import RoomLeft, SamplingParams


def request_sampling(
    sampling: SamplingParams | None,
    fields: dict[str, Any],
    limits: InputLimits,
    vocab_size: int | None,
    context_length: int | None,
) -> tuple[SamplingParams, RoomLeft | None]:
    """The validated SamplingParams and the room asked for (None: max_new_tokens as given).
    `fields` are SamplingParams' (SAMPLING_FIELDS, checked by the caller). RequestError or
    LimitExceeded (ValueError, `field` naming it) for a bad value. `vocab_size` /
    `context_length` None: not started."""
    fields = dict(fields)
    room = fields.get("max_new_tokens")
    if isinstance(room, RoomLeft):
        del fields["max_new_tokens"]
    else:
        room = None
    if sampling is None or fields:
        given = {} if sampling is None else msgspec.structs.asdict(sampling)
        sampling = sampling_from({**given, **fields})
    if room is not None:  # validated at the most it may come to
        context = context_length if context_length is not None else 1
        most = context if room.at_most is None else room.at_most
        sampling = msgspec.structs.replace(sampling, max_new_tokens=most)
    sampling.validate(vocab_size, limits)
    return sampling, room
