"""What the decode server and the prefill server's bootstrap endpoint say to each other
(disagg/bootstrap.py), one JSON body each way."""

from __future__ import annotations

import hashlib
from array import array

import msgspec

from shoal.disagg.layout import KVLayout
from shoal.results import TokenLogprob


class RoomRequest(msgspec.Struct, frozen=True):
    """The decode server's pages for one room: write the prompt's KV for positions
    skip_tokens .. num_tokens - 1 into `pages` (pages[i] holds the page of position
    skip_tokens + i * page_size), then answer."""

    endpoint: str  # the decode server's transfer endpoint (backend-specific)
    layout: KVLayout
    pages: tuple[int, ...]
    skip_tokens: int  # page-aligned: the decode server's own prefix-cache hit
    num_tokens: int
    prompt_digest: str  # prompt_digest() of the prompt's token ids


class RoomResult(msgspec.Struct, frozen=True):
    """The prefill server's answer, sent only once no write for the room can still land."""

    ok: bool
    error: str = ""
    refused: bool = False  # the prefill server refused the request as given (a 4xx)
    first_token: int = -1
    logprob: TokenLogprob | None = None
    weight_version: int = 0


class CancelResult(msgspec.Struct, frozen=True):
    """DELETE's answer: the room is ended and no write for it is or will be in flight."""

    stopped: bool


def prompt_digest(token_ids: tuple[int, ...] | list[int]) -> str:
    """A short fingerprint of a prompt, so both servers know they hold the same one."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12).hexdigest()
