"""How deeply a JSON text nests arrays and objects, checked before it is decoded.

    if nests_deeper(raw, 32):        # then refuse: never hand it to msgspec
        ...

msgspec decodes recursively: a body of a few thousand `[` makes it raise RecursionError (a 500
before this check). The check is linear in the body and runs at C speed in bounded memory:

  1. a body with at most `max_depth` of `[` and `{` cannot nest deeper: no scan (every
     ordinary request; two C `count` calls);
  2. otherwise escaped backslashes and quotes are removed (two C `replace` calls), so every
     remaining `"` opens or closes a string;
  3. then, 1 MiB at a time with numpy, a byte is inside a string when an odd number of quotes
     precede it; the brackets outside strings step +1 / -1 and the running depth is their
     cumulative sum, carried from chunk to chunk; the scan stops at the first chunk that goes
     past `max_depth`.

Malformed JSON (an unclosed string, unbalanced brackets) is not this check's concern: the
decoder refuses it, and the depth it reaches is bounded here either way.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_JSON_DEPTH = 32
CHUNK_BYTES = 1 << 20
QUOTE = ord('"')

_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def nests_deeper(raw: bytes, max_depth: int) -> bool:
    """Whether arrays and objects in `raw` (outside strings) nest deeper than max_depth."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(raw, np.uint8)
    num_quotes = 0  # before the chunk: odd means the chunk starts inside a string
    depth = 0  # before the chunk
    for start in range(0, len(data), CHUNK_BYTES):
        chunk = data[start : start + CHUNK_BYTES]
        steps = _STEP[chunk]
        quotes = chunk == QUOTE
        if num_quotes % 2 or quotes.any():
            inside = ((np.cumsum(quotes, dtype=np.int32) + num_quotes) & 1).astype(bool)
            steps[inside] = 0
            num_quotes += int(np.count_nonzero(quotes))
        running = np.cumsum(steps, dtype=np.int32)
        if depth + int(running.max()) > max_depth:
            return True
        depth += int(running[-1])
    return False
