"""The typed seams between the engine and the doors (docs/architecture.md, "Typed seams"): a
refusal's HTTP status and param come from its code and field, never from its message text."""

from __future__ import annotations

import pytest

from shoal.actors.replies import SchedulerSnapshot
from shoal.api.http.errors import STATUS_OF, FieldNames, from_engine, refused
from shoal.limits import TOO_LONG, LimitExceeded
from shoal.results import ERROR_CODES, FINISH_REASONS, ErrorCode, RequestError


def test_the_closed_sets() -> None:
    assert FINISH_REASONS == ("stop", "length", "abort", "error")
    assert set(STATUS_OF) <= set(ERROR_CODES)
    assert TOO_LONG in ERROR_CODES  # limits.py's codes belong to the set


@pytest.mark.parametrize("code", ERROR_CODES)
def test_every_code_answers_a_client_error_with_itself(code: ErrorCode) -> None:
    error = refused(RequestError("refused", "top_p", code), "top_p")
    assert 400 <= error.status < 500
    assert error.code == code and error.param == "top_p" and error.message == "refused"


def test_status_and_param_come_from_code_and_field_not_from_the_text() -> None:
    misleading = "too many sessions: the context length and the request id are wrong"
    busy = RequestError(misleading, "session_id", "session_busy")
    error = from_engine(busy, FieldNames("messages", "session_params.id"))
    assert (error.status, error.param, error.code) == (409, "session_params.id", "session_busy")
    prompt = RequestError(misleading, "max_new_tokens")
    error = from_engine(prompt, FieldNames("messages"))
    assert (error.status, error.param, error.code) == (400, "messages", "invalid_value")
    rid = RequestError("in use", "rid")
    assert from_engine(rid, FieldNames("messages")).param == "rid"
    many = RequestError("no room", None, "too_many_sessions")
    refusal = from_engine(many, FieldNames("prompt"))
    assert (refusal.status, refusal.param) == (429, None)


def test_a_limit_and_a_plain_value_error() -> None:
    limit = LimitExceeded("stop", "stop is 9 characters, more than 8", TOO_LONG)
    error = from_engine(limit, FieldNames("prompt"))
    assert (error.status, error.code) == (400, TOO_LONG)
    plain = from_engine(
        ValueError("give exactly one of prompt, input_ids or messages"), FieldNames("text")
    )
    assert (plain.status, plain.param, plain.code) == (400, "text", "invalid_value")


def test_a_snapshot_says_what_keeps_the_engine_busy() -> None:
    def snapshot(**phases: tuple[str, ...]) -> SchedulerSnapshot:
        empty: dict[str, tuple[str, ...]] = dict.fromkeys(
            ("waiting", "prefill", "running", "retracting", "finishing"), ()
        )
        return SchedulerSnapshot(
            **{**empty, **phases},
            launched_batches={},
            rows={},
            progress={},
            plan_pending=False,
            paused=False,
            num_retractions=0,
            idle=False,
        )

    assert snapshot(running=("a", "b"), finishing=("c",)).busy_summary() == (
        "2 running, 1 finishing"
    )
    assert snapshot().busy_summary() == "a batch in flight"


def test_a_refusal_keeps_its_field_and_detail_and_each_door_says_its_own_name() -> None:
    sampled = RequestError(" must be >= 1, got 0", "max_new_tokens", named=True)
    assert str(sampled) == "max_new_tokens must be >= 1, got 0"  # the Python caller's
    assert (sampled.field, sampled.detail) == ("max_new_tokens", " must be >= 1, got 0")
    error = refused(sampled, "max_tokens")
    assert (error.param, error.message) == ("max_tokens", "max_tokens must be >= 1, got 0")
    names = FieldNames("prompt[1]", sampling={"max_new_tokens": "sampling_params.max_new_tokens"})
    error = from_engine(sampled, names)
    assert error.message == "sampling_params.max_new_tokens must be >= 1, got 0"
    prompt = RequestError(" is 300 tokens", "prompt", "context_length_exceeded", named=True)
    error = from_engine(prompt, names)
    assert (error.param, error.message) == ("prompt[1]", "prompt[1] is 300 tokens")
    limit = LimitExceeded("stop", " has 9 entries, more than 8", "array_above_max_length")
    assert str(limit) == "stop has 9 entries, more than 8"
    assert refused(limit, "sampling_params.stop").message.startswith("sampling_params.stop has")
    busy = RequestError("session 's' is busy", "session_id", "session_busy")  # not named
    assert from_engine(busy, names).message == "session 's' is busy"
