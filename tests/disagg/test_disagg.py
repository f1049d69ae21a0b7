"""Prefill/decode disaggregation with the in-process transfer backend ("local"): two engines
in one process, the prefill one serving the bootstrap endpoint on 127.0.0.1, KV moved by
`LocalFabric` copies (docs/disaggregation.md).

Greedy tokens through a prefill and a decode engine equal one engine's, and a failure
anywhere ends the request on both: a rejected write, a vanished peer, a timeout, an abort in
each state, a request the prefill side refuses, a different weight version or KV layout, and
SGLang's window (its issue #26912: a transfer failing while the request sits in the
bootstrap queue, with pipeline stages on the prefill side). Each test ends with both engines
idle, no page or row leaked (the make_engine fixture checks), the transfer gauges at 0, and
the next request served. Windows are opened with seams (the step gate, held writes), never
with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from disagg_helpers import NEW_TOKENS, WAIT_S, free_port, wait_for_counts
from engines import EngineFactory, message_kinds
from parity import copying_prompts, mixed_prompts
from reference import Reference

from shoal import Engine
from shoal.actors.transfer_messages import TransferMsg
from shoal.disagg.backend import LocalFabric
from shoal.disagg.layout import KVLayout
from shoal.disagg.wire import RoomRequest
from shoal.models.load import LoadedModel
from shoal.params import Bootstrap
from shoal.results import Completion, RequestStream

rooms = itertools.count(1)


class Pair:
    def __init__(self, prefill: Engine, decode: Engine, fabric: LocalFabric) -> None:
        self.prefill, self.decode, self.fabric = prefill, decode, fabric

    def bootstrap(self) -> Bootstrap:
        port = self.prefill.bootstrap_port
        assert port is not None
        return Bootstrap("127.0.0.1", port, next(rooms))

    def halves(self, prompt: list[int], **sampling: Any) -> tuple[RequestStream, RequestStream]:
        """Both halves of one greedy request, as the router sends them: (prefill's, decode's)
        streams."""
        b = self.bootstrap()
        sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, **sampling}
        first = self.prefill.generate(input_ids=prompt, bootstrap=b, **sampling)
        second = self.decode.generate(input_ids=prompt, bootstrap=b, **sampling)
        return first, second

    async def run(self, prompt: list[int], **sampling: Any) -> tuple[Any, Any]:
        """Both halves' outcomes (a Completion or the error raised)."""
        first, second = self.halves(prompt, **sampling)
        return tuple(await asyncio.gather(first.result(), second.result(), return_exceptions=True))

    async def idle(self) -> None:
        for engine in (self.prefill, self.decode):
            await engine.wait_idle(WAIT_S)
            counts = await engine.transfer_counts()
            assert set(counts.values()) == {0}, counts


PairFactory = Callable[..., Any]


@pytest.fixture
def make_pair(make_engine: EngineFactory) -> PairFactory:
    async def make(prefill: dict[str, Any] | None = None, **options: Any) -> Pair:
        fabric = LocalFabric()
        common = {
            "disaggregation_transfer_backend": "local",
            "disaggregation_bootstrap_port": 0,
            "disaggregation_timeout_s": 5.0,
            "fabric": fabric,
            **options,
        }
        first = await make_engine(disaggregation_mode="prefill", **{**common, **(prefill or {})})
        peers = f"127.0.0.1:{first.bootstrap_port}"  # the one prefill server it may contact
        second = await make_engine(
            disaggregation_mode="decode", disaggregation_prefill_peers=peers, **common
        )
        return Pair(first, second, fabric)

    return make


def error_of(outcome: Any) -> str:
    """The message a half ended with: a raised error's, or an abort Completion's."""
    if isinstance(outcome, BaseException):
        return str(outcome)
    assert isinstance(outcome, Completion) and outcome.finish_reason in ("abort", "error")
    return outcome.message


async def served_after(pair: Pair, reference: Reference, vocab: int) -> None:
    """The next request goes through and both sides end idle."""
    prompt = mixed_prompts(vocab)[1]
    first, second = await pair.run(prompt)
    assert first.token_ids == tuple(reference.greedy(prompt, 1))
    assert list(second.token_ids) == reference.greedy(prompt, NEW_TOKENS)
    await pair.idle()


# ---- the output is one engine's ---------------------------------------------------------


@pytest.mark.usefixtures("eager_drafts")  # drafts at every match (conftest.py)
async def test_greedy_with_drafts_through_both_equals_one_engine(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """Speculative decoding on the decode server: its drafts are verified over the prompt's
    KV the prefill server wrote, and the tokens are one engine's."""
    pair = await make_pair(page_size=4, speculative_algorithm="ngram")
    prompts = copying_prompts(tiny_model.config.vocab_size)
    outcomes = await asyncio.gather(*(pair.run(p, max_new_tokens=24) for p in prompts))
    for prompt, (first, second) in zip(prompts, outcomes, strict=True):
        want = tiny_reference.greedy(prompt, 24)
        assert first.token_ids == (want[0],)
        assert list(second.token_ids) == want
    await pair.idle()
    assert (await pair.decode.snapshot()).spec_accepted > 0
    assert (await pair.prefill.snapshot()).spec_steps == 0  # its requests end at a first token


@pytest.mark.parametrize("page_size", [16, 1])
async def test_greedy_through_both_equals_one_engine(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference, page_size: int
) -> None:
    pair = await make_pair(page_size=page_size)
    prompts = mixed_prompts(tiny_model.config.vocab_size)
    outcomes = await asyncio.gather(*(pair.run(p) for p in prompts))
    for prompt, (first, second) in zip(prompts, outcomes, strict=True):
        want = tiny_reference.greedy(prompt, NEW_TOKENS)
        assert first.token_ids == (want[0],) and first.finish_reason == "length"
        assert list(second.token_ids) == want
    await pair.idle()
    assert pair.fabric.bytes_written > 0


async def test_seeded_sampling_penalties_and_logprobs_equal_one_engines(
    make_pair: PairFactory, make_engine: EngineFactory, tiny_model: LoadedModel
) -> None:
    """Not only greedy: a seeded sample with penalties draws the same tokens, and reports the
    same logprobs, as one engine (the first token and its logprob come from the prefill
    server; the decode server's sampler starts from it)."""
    pair = await make_pair()
    solo = await make_engine()
    sampling = {
        "temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    for i, prompt in enumerate(mixed_prompts(tiny_model.config.vocab_size)):
        _, second = await pair.run(prompt, seed=100 + i, **sampling)
        alone = await solo.generate(
            input_ids=prompt, max_new_tokens=NEW_TOKENS, seed=100 + i, **sampling
        ).result()
        assert second.token_ids == alone.token_ids
        assert second.logprobs == alone.logprobs
    await pair.idle()


async def test_a_row_with_a_grammar_through_both_equals_one_engine(
    make_pair: PairFactory, make_engine: EngineFactory, tiny_model: LoadedModel
) -> None:
    """A grammar row's first token is the prefill server's, masked by its grammar; the decode
    server's row starts its matcher from it (kernels/constraints.py, advance_all) and goes on
    as one engine would, seeded sampling included; it ends with "stop" where the grammar does."""
    pair = await make_pair()
    solo = await make_engine()
    grammar = {"regex": "[a-z]{2,5}-[0-9]{1,3}", "max_new_tokens": 20}
    for i, prompt in enumerate(mixed_prompts(tiny_model.config.vocab_size)):
        sampling = {**grammar, "seed": 100 + i, "temperature": 0.0 if i % 2 else 1.0}
        _, second = await pair.run(prompt, **sampling)
        alone = await solo.generate(input_ids=prompt, **sampling).result()
        assert second.token_ids == alone.token_ids and second.finish_reason == "stop"
    await pair.idle()


async def test_the_kv_is_the_prefill_servers(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """The decode side computes no prompt token itself: zeroing the KV (the source pages
    among it) while the write is held changes what the decode server generates."""
    pair = await make_pair()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[3]
    pair.fabric.hold_writes()
    first, second = pair.halves(prompt)
    await asyncio.to_thread(pair.fabric.wait_writing, 1)
    for regions in pair.fabric.endpoints.values():
        for addr, size in regions:
            ctypes.memset(addr, 0, size)
    pair.fabric.release_writes()
    await first.result()
    got = (await second.result()).token_ids
    assert list(got) != tiny_reference.greedy(prompt, NEW_TOKENS)
    await pair.idle()


async def test_a_prefix_the_decode_server_holds_is_not_sent_again(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[3]  # 96 tokens: 5 full pages
    for attempt in range(2):
        before = pair.fabric.bytes_written
        _, second = await pair.run(prompt)
        assert list(second.token_ids) == tiny_reference.greedy(prompt, NEW_TOKENS)
        sent = pair.fabric.bytes_written - before
        if attempt == 0:
            full = sent
    assert 0 < sent < full  # the decode server's tree had the first pages: only the rest came
    await pair.idle()


async def test_a_first_token_that_ends_the_request_needs_no_decode_step(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[2]
    first, second = await pair.run(prompt, max_new_tokens=1)
    assert first.token_ids == second.token_ids == tuple(tiny_reference.greedy(prompt, 1))
    assert second.finish_reason == "length"
    await pair.idle()


async def test_without_disaggregation_a_bootstrap_is_ignored(
    make_engine: EngineFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    engine = await make_engine()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[1]
    done = await engine.generate(
        input_ids=prompt,
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        bootstrap=Bootstrap("127.0.0.1", 1, 1),
    ).result()
    assert list(done.token_ids) == tiny_reference.greedy(prompt, NEW_TOKENS)
    assert await engine.transfer_counts() == {}


# ---- a failure anywhere ends the request on both sides -----------------------------------


async def test_a_rejected_write_ends_both_halves(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair()
    pair.fabric.reject_next_write("write rejected by the test")
    first, second = await pair.run(mixed_prompts(tiny_model.config.vocab_size)[2])
    assert "write rejected by the test" in error_of(first)
    assert "write rejected by the test" in error_of(second)
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


async def test_a_room_missing_a_half_times_out_on_both_sides(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair(prefill={"disaggregation_timeout_s": 0.5})
    prompt = mixed_prompts(tiny_model.config.vocab_size)[1]
    b = pair.bootstrap()
    alone = await pair.decode.generate(input_ids=prompt, bootstrap=b).result()
    assert "no prefill request arrived for room" in error_of(alone)
    b = pair.bootstrap()
    alone = await pair.prefill.generate(input_ids=prompt, bootstrap=b).result()
    assert "no decode server arrived for room" in error_of(alone)
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


async def test_a_request_the_prefill_side_refuses_fails_on_the_decode_side(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """SGLang's router sends the decode server the request even when the prefill server
    refused it: the decode side hears the prefill side's reason, not a timeout."""
    pair = await make_pair(disaggregation_timeout_s=30.0)
    vocab = tiny_model.config.vocab_size
    prompt = mixed_prompts(vocab)[1]
    b = pair.bootstrap()
    refused = pair.prefill.generate(input_ids=[*prompt, vocab + 5], bootstrap=b)
    waiting = pair.decode.generate(input_ids=prompt, bootstrap=b)
    first, second = await asyncio.wait_for(
        asyncio.gather(refused.result(), waiting.result(), return_exceptions=True), WAIT_S
    )
    assert "vocab" in error_of(first)
    assert "the prefill server" in error_of(second) and "vocab" in error_of(second)
    await pair.idle()
    await served_after(pair, tiny_reference, vocab)


async def test_the_weights_are_matched_by_their_digest_not_their_version(
    make_pair: PairFactory,
    tiny_model: LoadedModel,
    tiny_reference: Reference,
    tiny_folder: Any,
    other_folder: Any,
) -> None:
    """weight_version is a counter (a restart resets it): the two servers compare the
    weights' digest instead. The same checkpoint loaded again (version 1 against 0) is no
    mismatch; another checkpoint is, on both halves, with code "weights_mismatch"."""
    pair = await make_pair()
    assert (await pair.decode.update_weights_from_disk(tiny_folder)).success
    assert (pair.decode.weight_version, pair.prefill.weight_version) == ("1", "0")
    assert pair.decode.weights_digest == pair.prefill.weights_digest
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)
    assert (await pair.decode.update_weights_from_disk(other_folder)).success
    assert pair.decode.weights_digest != pair.prefill.weights_digest
    written = pair.fabric.bytes_written
    first, second = await pair.run(mixed_prompts(tiny_model.config.vocab_size)[1])
    for half in (first, second):
        assert half.finish_reason == "error" and half.code == "weights_mismatch", half
        assert "different weights" in half.message or "other weights" in half.message
    assert pair.fabric.bytes_written == written  # refused before anything was written
    await pair.idle()
    assert (await pair.decode.update_weights_from_disk(tiny_folder)).success
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


@pytest.mark.parametrize("first", ["decode asks first", "prefill computes first"])
async def test_a_different_kv_layout_is_refused(
    make_pair: PairFactory, tiny_model: LoadedModel, first: str
) -> None:
    pair = await make_pair(prefill={"page_size": 8})
    if first == "prefill computes first":
        pair.decode.testing.hold()  # its request waits: the prefill room has the KV before the peer
    firsts = pair.halves(mixed_prompts(tiny_model.config.vocab_size)[1])
    if first == "prefill computes first":  # its request holds the KV, in TRANSFER
        for _ in range(int(WAIT_S / 0.005)):
            if (await pair.prefill.snapshot()).transfer:
                break
            await asyncio.sleep(0.005)
        assert (await pair.prefill.transfer_counts())["bootstrap"] == 1
        pair.decode.testing.release()
    outcomes = await asyncio.gather(*(s.result() for s in firsts), return_exceptions=True)
    for outcome in outcomes:
        assert "KV layouts differ: page_size" in error_of(outcome)
    await pair.idle()


async def test_a_different_prompt_in_the_same_room_is_refused(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair()
    prompts = mixed_prompts(tiny_model.config.vocab_size)
    b = pair.bootstrap()
    first = pair.prefill.generate(input_ids=prompts[1], bootstrap=b, temperature=0.0)
    second = pair.decode.generate(input_ids=prompts[2], bootstrap=b, temperature=0.0)
    for stream in (first, second):
        assert "holds a different prompt" in error_of(await stream.result())
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


# ---- aborts, in each state ---------------------------------------------------------------


async def test_a_decode_abort_while_the_prompt_is_computed_ends_the_prefill_half(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair()
    pair.prefill.testing.hold()  # the prefill request stays unscheduled: its room waits for its KV
    b = pair.bootstrap()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[2]
    first = pair.prefill.generate(input_ids=prompt, bootstrap=b)
    second = pair.decode.generate(input_ids=prompt, bootstrap=b)
    await wait_for_counts(pair.prefill, prefilling=1)
    pair.decode.abort(second.rid, "the client went away")
    assert (await second.result()).finish_reason == "abort"
    assert "the decode server cancelled: the client went away" in error_of(await first.result())
    pair.prefill.testing.release()
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_an_abort_while_the_write_runs_frees_pages_only_after_it(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference, side: str
) -> None:
    """vLLM's bug was the opposite: blocks freed on a lease expiry while the peer still
    wrote them. Here the aborted side keeps its row and pages until the write returned."""
    pair = await make_pair()
    pair.fabric.hold_writes()
    b = pair.bootstrap()
    prompt = mixed_prompts(tiny_model.config.vocab_size)[3]
    first = pair.prefill.generate(input_ids=prompt, bootstrap=b)
    second = pair.decode.generate(input_ids=prompt, bootstrap=b)
    await asyncio.to_thread(pair.fabric.wait_writing, 1)
    aborted, other = (second, first) if side == "decode" else (first, second)
    engine = pair.decode if side == "decode" else pair.prefill
    engine.abort(aborted.rid, "the client went away")
    if side == "decode":
        await wait_for_counts(pair.decode, cancelling=1)
    assert (await aborted.result()).finish_reason == "abort"
    for _ in range(20):  # whatever it takes to process the abort: the pages stay
        await asyncio.sleep(0)
    snapshot = await engine.snapshot()
    assert aborted.rid in snapshot.rows and aborted.rid in snapshot.finishing
    pair.fabric.release_writes()
    assert "the client went away" in error_of(await other.result())
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_abort_all_on_either_side(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference, side: str
) -> None:
    pair = await make_pair()
    engine = pair.decode if side == "decode" else pair.prefill
    prompts = mixed_prompts(tiny_model.config.vocab_size)
    pairs = []
    for prompt in prompts:
        b = pair.bootstrap()
        pairs.append(
            (
                pair.prefill.generate(input_ids=prompt, bootstrap=b, max_new_tokens=40),
                pair.decode.generate(input_ids=prompt, bootstrap=b, max_new_tokens=40),
            )
        )
    await asyncio.sleep(0.05)  # some computing, some transferring, some decoding: any mix
    for first, second in pairs:
        engine.abort((second if side == "decode" else first).rid, "abort_all")
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(s.result() for p in pairs for s in p), return_exceptions=True), WAIT_S
    )
    assert all(not isinstance(o, BaseException) or "abort" in str(o) for o in outcomes)
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


# ---- pipeline stages on the prefill side -------------------------------------------------


async def test_sglang_26912_a_failure_in_the_bootstrap_queue_with_stages(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """SGLang's #26912: with pipeline stages and disaggregation, a prefill request whose
    transfer failed while it sat in the bootstrap queue stayed there forever and the queue
    gauge never went back to 0. Here the decode side's request is aborted before it ever
    reached the prefill server (so the prefill request sits in "bootstrap"): the room ends,
    the prefill request ends with the cause, and every gauge returns to 0."""
    pair = await make_pair(prefill={"pipeline_stages": 2})
    vocab = tiny_model.config.vocab_size
    prompt = mixed_prompts(vocab)[2]
    pair.prefill.testing.hold()
    pair.decode.testing.hold()  # the decode request waits in its queue: it never asks for KV
    b = pair.bootstrap()
    first = pair.prefill.generate(input_ids=prompt, bootstrap=b)
    second = pair.decode.generate(input_ids=prompt, bootstrap=b)
    await wait_for_counts(pair.prefill, bootstrap=1)
    pair.decode.abort(second.rid, "the router aborted it")
    assert (await second.result()).finish_reason == "abort"
    assert "the router aborted it" in error_of(await first.result())
    await wait_for_counts(pair.prefill, bootstrap=0)
    pair.prefill.testing.release()
    pair.decode.testing.release()
    await pair.idle()
    await served_after(pair, tiny_reference, vocab)


async def test_a_failing_later_stage_ends_both_halves(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    pair = await make_pair(prefill={"pipeline_stages": 2})
    pair.prefill.testing.stages.fail_next(1)
    first, second = await pair.run(mixed_prompts(tiny_model.config.vocab_size)[2])
    assert "forward failed" in error_of(first) and "forward failed" in error_of(second)
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


# ---- a server that goes away -------------------------------------------------------------


async def test_a_server_killed_mid_transfer(
    tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    """Each side killed while the other waits: the survivor ends the request with the cause
    and is idle, with nothing leaked, and serves a fresh peer's next request."""
    fabric = LocalFabric()
    port = free_port()  # the prefill server's, across its restart: the decode server's peer
    common: dict[str, Any] = {
        "disaggregation_transfer_backend": "local",
        "disaggregation_bootstrap_port": port,
        "disaggregation_prefill_peers": f"127.0.0.1:{port}",
        "disaggregation_timeout_s": 5.0,
        "fabric": fabric,
        "strict_integrity": True,
        "dtype": "float32",  # as make_engine's (auto: bfloat16 with AMX or AVX512-BF16)
    }
    vocab = tiny_model.config.vocab_size
    prompt = mixed_prompts(vocab)[3]
    prefill = await Engine(tiny_model, disaggregation_mode="prefill", **common).start()
    decode = await Engine(tiny_model, disaggregation_mode="decode", **common).start()
    try:
        # The decode server dies while the prefill server writes into it.
        fabric.hold_writes()
        pair = Pair(prefill, decode, fabric)
        b = pair.bootstrap()
        first = prefill.generate(input_ids=prompt, bootstrap=b)
        decode.generate(input_ids=prompt, bootstrap=b)
        await asyncio.to_thread(fabric.wait_writing, 1)
        await decode.close()
        fabric.release_writes()
        assert "is gone" in error_of(await first.result())
        decode = await Engine(tiny_model, disaggregation_mode="decode", **common).start()
        pair = Pair(prefill, decode, fabric)
        await pair.idle()
        await served_after(pair, tiny_reference, vocab)
        # The prefill server dies while the decode server waits for its KV.
        prefill.testing.hold()
        b = pair.bootstrap()
        prefill.generate(input_ids=prompt, bootstrap=b)
        second = decode.generate(input_ids=prompt, bootstrap=b)
        await wait_for_counts(prefill, prefilling=1)
        await prefill.close()
        assert "the prefill server" in error_of(await second.result())
        prefill = await Engine(tiny_model, disaggregation_mode="prefill", **common).start()
        pair = Pair(prefill, decode, fabric)
        await pair.idle()
        await served_after(pair, tiny_reference, vocab)
        await decode.check_integrity()
        await prefill.check_integrity()
    finally:
        fabric.release_writes()
        await prefill.close()
        await decode.close()


# ---- a fault in any disaggregation message fails only its request ------------------------


TRANSFER_FAULTS = [("transfer", kind) for kind in message_kinds(TransferMsg)] + [
    ("scheduler", "TransferEnded")
]
PREFILL_ONLY = {"ClaimRoom", "SendKV", "WriteEnded", "RoomDeadline", "PeerArrived", "PeerCancel"}
PREFILL_ONLY |= {"PeerGone"}
DECODE_ONLY = {"ExpectKV", "PollEnded", "CancelEnded"}


async def _transfer_workload(pair: Pair, vocab: int) -> None:
    """Sends every disaggregation message kind at least once; outcomes may be errors."""
    prompts = mixed_prompts(vocab)

    async def bounded(work: Any) -> None:
        await asyncio.wait_for(asyncio.gather(work, return_exceptions=True), WAIT_S)

    await bounded(pair.run(prompts[1]))  # claim, arrive, send, write, expect, poll, ended
    pair.prefill.testing.hold()  # a decode abort while the prompt waits: drop, cancel, cancelled
    b = pair.bootstrap()
    first = pair.prefill.generate(input_ids=prompts[2], bootstrap=b)
    second = pair.decode.generate(input_ids=prompts[2], bootstrap=b)
    await bounded(wait_for_counts(pair.prefill, prefilling=1))
    pair.decode.abort(second.rid, "the client went away")
    await bounded(second.result())
    await bounded(first.result())
    pair.prefill.testing.release()
    b = pair.bootstrap()  # a room whose request never comes: its deadline
    await bounded(pair.prefill.generate(input_ids=prompts[2], bootstrap=b).result())
    url = f"http://127.0.0.1:{pair.prefill.bootstrap_port}/shoal/pd/rooms/{next(rooms)}"
    layout = KVLayout(1, 1, 1, 16, "torch.float32", 64, 1, (0,), (0,))
    body = msgspec.json.encode(RoomRequest("nowhere", layout, (0,), 0, 1, "no prompt"))
    async with aiohttp.ClientSession() as http:  # a decode server that hangs up: gone
        with contextlib.suppress(TimeoutError):
            await http.post(url, data=body, timeout=aiohttp.ClientTimeout(total=0.2))
    await bounded(pair.idle())


@pytest.mark.parametrize(
    ("actor", "kind"), TRANSFER_FAULTS, ids=[f"{a}-{k}" for a, k in TRANSFER_FAULTS]
)
async def test_a_fault_in_one_transfer_message_fails_only_that_message(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference, actor: str,
    kind: str,
) -> None:  # fmt: skip
    pair = await make_pair(prefill={"disaggregation_timeout_s": 0.5})
    sides = [pair.decode] if kind in DECODE_ONLY else [pair.prefill]
    if kind not in PREFILL_ONLY | DECODE_ONLY:
        sides = [pair.prefill, pair.decode]
    for engine in sides:
        engine.testing.faults.arm(actor, kind)
    await _transfer_workload(pair, tiny_model.config.vocab_size)
    fired = [f for engine in sides for f in engine.testing.faults.fired]
    assert (actor, kind) in fired, f"never sent {kind} to the {actor}"
    for engine in (pair.prefill, pair.decode):
        assert engine.dead_reason is None, engine.dead_reason
    await pair.idle()
    await served_after(pair, tiny_reference, tiny_model.config.vocab_size)


async def test_a_flush_and_a_weight_update_wait_for_a_transfer(
    make_pair: PairFactory, tiny_model: LoadedModel, tiny_reference: Reference, tiny_folder: Any
) -> None:
    """A request whose KV is being written holds its pages on both servers: a flush finds
    neither idle, and a weight update waits for it (law 1 and the update lock, unchanged)."""
    pair = await make_pair()
    vocab = tiny_model.config.vocab_size
    prompt = mixed_prompts(vocab)[3]
    pair.fabric.hold_writes()
    first, second = pair.halves(prompt)
    await asyncio.to_thread(pair.fabric.wait_writing, 1)
    for engine in (pair.prefill, pair.decode):
        refused = await engine.flush_cache(timeout_s=0.2)
        assert not refused.success and "transferring KV" in refused.message, refused
    update = asyncio.create_task(pair.prefill.update_weights_from_disk(tiny_folder))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not update.done()
    pair.fabric.release_writes()
    assert (await first.result()).finish_reason == "length"
    assert list((await second.result()).token_ids) == tiny_reference.greedy(prompt, NEW_TOKENS)
    assert (await update).success
    assert (await pair.decode.update_weights_from_disk(tiny_folder)).success
    await pair.idle()
    await served_after(pair, tiny_reference, vocab)
