"""The model-update lock (actors/tokenizer/update_lock.py) on its own: plain Python, no engine, no
asyncio. Its invariants (docs/architecture.md, law 2 and "Weight updates, cache flush and
pause") asked as its owner, the tokenizer actor, asks them."""

from __future__ import annotations

from typing import Any

from shoal.actors.messages import Generate
from shoal.actors.tokenizer.update_lock import UpdateLock, next_version
from shoal.actors.writer_messages import DiskWeights, UpdateWeights
from shoal.params import SamplingParams


def gen(rid: str) -> Generate:
    stream: Any = None  # never read by the lock
    return Generate(rid, None, (5, 6), None, SamplingParams(), stream)


def writer(path: str, version: str | None = None) -> UpdateWeights:
    reply: Any = None  # answered by the lock's owner, never by the lock
    return UpdateWeights(DiskWeights(path), False, version, reply)


def test_a_writer_waits_for_every_reader_and_new_requests_queue_behind_it() -> None:
    lock = UpdateLock()
    assert not lock.defer(gen("a"))  # no writer: admitted at once
    lock.enter("a")
    update = writer("/new")
    lock.request(update)
    assert lock.defer(gen("b")) and lock.defer(gen("c"))
    assert lock.next_writer() is None  # "a" still reads
    assert lock.release_queue() == []
    lock.leave(("a",))
    assert lock.next_writer() == (update, False)
    assert lock.next_writer() is None  # one at a time
    assert lock.defer(gen("d"))  # still queued while it works
    assert lock.done(True) is update and lock.version == "1"
    assert [g.rid for g in lock.release_queue()] == ["b", "c", "d"]
    assert lock.release_queue() == [] and not lock.writing


def test_the_queue_waits_for_the_last_writer_and_versions_follow_each() -> None:
    lock = UpdateLock()
    first, second = writer("/first", "7"), writer("/second")
    lock.request(first)
    lock.request(second)
    assert lock.defer(gen("a"))
    assert lock.next_writer() == (first, False)
    assert lock.done(True) is first and lock.version == "7"
    assert lock.release_queue() == []  # the second still waits
    assert lock.next_writer() == (second, False)
    assert lock.done(False) is second and lock.version == "7"  # a failed load keeps it
    assert [g.rid for g in lock.release_queue()] == ["a"]
    assert lock.done(True) is None  # no writer at work: nothing to finish


def test_while_paused_a_writer_starts_at_once_and_parks_the_readers() -> None:
    lock = UpdateLock()
    lock.enter("a")
    update = writer("/new")
    lock.request(update)
    lock.set_paused(True)
    assert not lock.may_resume()
    assert lock.next_writer() == (update, True)


def test_a_resume_while_a_writer_works_waits_for_its_end() -> None:
    """test_continue_during_a_paused_update_waits_for_the_new_weights, as the lock sees it."""
    lock = UpdateLock()
    lock.enter("a")
    lock.set_paused(True)
    lock.request(writer("/new"))
    assert lock.next_writer() is not None
    lock.set_paused(False)
    assert not lock.may_resume()  # the parked request must not run on the old weights
    lock.done(True)
    assert lock.may_resume()


def test_queued_requests_and_withdrawn_writers_leave_the_lock() -> None:
    lock = UpdateLock()
    update = writer("/new")
    lock.request(update)
    lock.defer(gen("a"))
    lock.defer(gen("b"))
    taken = lock.take_queued("a")
    assert taken is not None and taken.rid == "a"
    assert lock.take_queued("a") is None
    lock.withdraw(update)
    lock.withdraw(update)  # not in line any more: nothing
    assert not lock.writing and lock.next_writer() is None
    assert [g.rid for g in lock.release_queue()] == ["b"]


def test_abandon_hands_back_every_queued_request_and_writer() -> None:
    lock = UpdateLock()
    working, waiting = writer("/working"), writer("/waiting")
    lock.request(working)
    lock.request(waiting)
    lock.next_writer()
    lock.defer(gen("a"))
    queued, writers = lock.abandon()
    assert [g.rid for g in queued] == ["a"] and writers == [working, waiting]
    assert not lock.writing and lock.abandon() == ([], [])


def test_an_update_without_a_version_moves_a_number_on_and_keeps_a_name() -> None:
    assert [next_version(v) for v in ("0", "41", "rl-step-7", "٣")] == ["1", "42", "rl-step-7", "٣"]
    lock = UpdateLock()
    for version, expected in (
        ("rl-step-7", "rl-step-7"),
        (None, "rl-step-7"),
        ("9", "9"),
        (None, "10"),
    ):
        lock.request(writer("/w", version))
        assert lock.next_writer() is not None
        lock.done(True)
        assert lock.version == expected
