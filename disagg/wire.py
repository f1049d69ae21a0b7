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
    weights_digest: str = ""  # the decode server's weights (loading/identity.py)

    def problem(self) -> str | None:
        """Why this request cannot be a decode server's (None: it can), checked where it
        arrives so that no room is opened for it."""
        layout = self.layout
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "page_bytes"):
            if getattr(layout, name) < 1:
                return f"layout.{name} must be >= 1"
        if layout.num_pages < 0 or min(self.skip_tokens, self.num_tokens) < 0:
            return "layout.num_pages, skip_tokens and num_tokens must be >= 0"
        if not len(layout.k_addrs) == len(layout.v_addrs) == layout.num_layers:
            return "layout.k_addrs and layout.v_addrs need one address per layer"
        if self.skip_tokens % layout.page_size or self.skip_tokens > self.num_tokens:
            return "skip_tokens must be a multiple of the page size, at most num_tokens"
        num_pages = -(-self.num_tokens // layout.page_size) - self.skip_tokens // layout.page_size
        if len(self.pages) != num_pages:
            return f"pages must hold {num_pages} pages for these tokens, got {len(self.pages)}"
        if any(not 0 <= page < layout.num_pages for page in self.pages):
            return f"every page must be in [0, layout.num_pages = {layout.num_pages})"
        return None


class RoomResult(msgspec.Struct, frozen=True):
    """The prefill server's answer, sent only once no write for the room can still land."""

    ok: bool
    error: str = ""
    refused: bool = False  # the prefill server refused the request as given (a 4xx)
    first_token: int = -1
    logprob: TokenLogprob | None = None
    weight_version: str = "0"  # the prefill server's public counter (informative only)
    weights_digest: str = ""  # the prefill server's weights: the decode server's must match


class CancelResult(msgspec.Struct, frozen=True):
    """DELETE's answer: the room is ended and no write for it is or will be in flight."""

    stopped: bool


def prompt_digest(token_ids: tuple[int, ...] | list[int]) -> str:
    """A short fingerprint of a prompt, so both servers know they hold the same one."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12).hexdigest()
