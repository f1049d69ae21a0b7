"""The planner's half of prefill/decode disaggregation (docs/disaggregation.md): what a
request with a bootstrap does differently, as functions over its `Req`.

A prefill server's request ("send") runs its prompt as usual; when its first token is
sampled it holds the token back, enters TRANSFER and asks the transfer actor to write the
prompt's pages (SendKV). A decode server's request ("receive") is admitted with a row and
pages like any other, then waits in TRANSFER (ExpectKV) instead of prefilling::

    send:     waiting ─▶ prefill ─first token─▶ transfer ─TransferEnded─▶ finishing (token out)
    receive:  waiting ─admit─▶ transfer ─TransferEnded(first token)─▶ prefill (that token's
                                                                      KV) ─▶ running ...

In TRANSFER a request holds its pages and `transfer_open` keeps them from release until the
transfer actor's TransferEnded says nothing can still write or read them, whatever ended the
request meanwhile (an abort, a failed step, the engine parking for a weight update). A `held`
TransferEnded (a decode server's silent peer) ends the request but leaves `transfer_open`:
its pages wait, quarantined, for the final one.
"""

from __future__ import annotations

from shoal.actors.messages import Admitted, TransferEnded
from shoal.actors.scheduler.request import Phase, Req, finish_reason
from shoal.actors.transfer_messages import ClaimRoom, DropRoom, ExpectKV, SendKV
from shoal.disagg.wire import prompt_digest
from shoal.results import TokenLogprob


def claim(req: Req) -> ClaimRoom | None:
    """On arrival: a prefill server books the room so the decode server's pages find it."""
    if req.role != "send" or req.bootstrap is None:
        return None
    return ClaimRoom(req.rid, req.bootstrap.room, prompt_digest(req.tokens[: req.num_prompt]))


def reserve_tokens(req: Req) -> int:
    """A receiving request's row also covers its first token, whose KV it computes itself."""
    return req.num_prompt + 1 if req.role == "receive" else len(req.tokens)


def admitted(req: Req, adm: Admitted, page_size: int) -> ExpectKV | None:
    """After admission: keep the pages; a receiving request waits for its KV."""
    req.pages = adm.pages
    if req.role != "receive" or req.bootstrap is None or req.phase is Phase.FINISHING:
        return None
    req.phase, req.transfer_open = Phase.TRANSFER, True
    num_pages = -(-req.num_prompt // page_size)
    skip = adm.num_cached_tokens
    return ExpectKV(
        req.rid,
        req.bootstrap,
        adm.pages[skip // page_size : num_pages],
        skip,
        req.num_prompt,
        prompt_digest(req.tokens[: req.num_prompt]),
    )


def first_token(req: Req, token: int, logprob: TokenLogprob | None, page_size: int) -> SendKV:
    """A sending request sampled its first token: hold it back and send the prompt's KV."""
    assert req.bootstrap is not None
    req.tokens.append(token)
    req.held_first = (token, logprob)
    req.phase, req.transfer_open = Phase.TRANSFER, True
    num_pages = -(-req.num_prompt // page_size)
    return SendKV(
        req.rid, req.bootstrap.room, req.pages[:num_pages], req.num_prompt, token, logprob
    )


def drop(req: Req, cause: str) -> DropRoom | None:
    """The request ended while its room is open: the transfer actor ends the room too."""
    if req.role is None or req.bootstrap is None:
        return None
    req.role = None
    return DropRoom(req.rid, req.bootstrap, cause)


def concerns(req: Req | None, done: TransferEnded) -> bool:
    """Whether a TransferEnded is news for this request (not a stale or repeated one)."""
    if req is None or req.bootstrap is None or req.bootstrap.room != done.room:
        return False
    return req.transfer_open or req.role is not None


def succeeded(
    req: Req, done: TransferEnded, eos_token_ids: tuple[int, ...]
) -> tuple[int, TokenLogprob | None, bool]:
    """A transfer ended well (the request is live, in TRANSFER): (the first token, its
    logprob, whether it ends the request). A sent request ends with it; a received one
    computes that token's KV next, as a one-token prefill chunk."""
    if req.role == "send":
        assert req.held_first is not None
        token, logprob = req.held_first
        req.phase, req.finish, req.role = Phase.FINISHING, "length", None
        return token, logprob, True
    token, logprob = done.first_token, done.logprob
    req.role = None  # from here on a local request (a retraction recomputes it here)
    req.tokens.append(token)
    req.num_launched = req.num_computed = req.num_prompt
    req.finish = finish_reason(req, token, eos_token_ids)
    if req.finish is not None:
        req.phase = Phase.FINISHING
    else:
        req.phase, req.needs_init = Phase.PREFILL, True
    return token, logprob, req.finish is not None
