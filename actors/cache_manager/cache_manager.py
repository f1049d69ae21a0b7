"""The cache manager actor: owns the request-slot table, page allocator and radix tree.

It answers one PlanRequest per step (releases first, then publishes, sliding-window trims,
extensions, then admissions in queue order, stopping at the first admission that does not
fit) and never one message per request. Trims come before extensions and admissions so that
the pages they free serve the same plan.
"""

from __future__ import annotations

import logging

from shoal.actors.executor_messages import RowWriteMsg
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Admitted,
    CacheMsg,
    CacheStats,
    CheckIntegrity,
    CloseSession,
    FlushCache,
    Plan,
    PlanRequest,
    SchedulerMsg,
    Shutdown,
)
from shoal.actors.replies import answer, settle
from shoal.actors.supervise import Fatal, FaultInjector, fail_replies, serve
from shoal.cache.kv import KVCache
from shoal.results import InternalError, OperationRefused

log = logging.getLogger("shoal.cache")


class CacheManager:
    def __init__(
        self,
        kv: KVCache,
        mailbox: Mailbox[CacheMsg],
        scheduler: Mailbox[SchedulerMsg],
        strict: bool,
        faults: FaultInjector | None = None,
    ) -> None:
        self.kv = kv
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.strict = strict
        self.faults = faults

    async def run(self) -> None:
        await serve("cache manager", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: CacheMsg) -> None:
        match msg:
            case PlanRequest() as req:
                self.scheduler.put(self.plan(req))
            case CheckIntegrity(reply=reply):
                violation = self.check(loud=reply is None and self.strict)
                if reply is not None:
                    settle(reply, violation)
            case CacheStats(reply=reply):
                answer(reply, self.kv.stats())
            case FlushCache(reply=reply):
                # Only ever sent while no request holds anything (the scheduler's idle
                # predicate, docs/architecture.md, law 1), so this cannot fail on a live
                # request.
                self.kv.flush()
                settle(reply, self.check(loud=False))
            case CloseSession(session_id=session_id):
                self.kv.close_session(session_id)
            case Shutdown():
                pass

    def recover(self, msg: CacheMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py). A plan half made, an integrity violation
        (with strict_integrity), or a flush that left the books inconsistent stop the
        engine; anything else fails its reply. A session whose KV could not be given back
        keeps it, still accounted for, until memory pressure reclaims it."""
        fail_replies(msg, error)
        match msg:
            case PlanRequest():
                raise Fatal("the cache manager could not make a plan") from error
            case CheckIntegrity(reply=None) if self.strict and self.check(loud=False) is not None:
                raise Fatal("the idle integrity check found a violation") from error
            case FlushCache() if self.check(loud=False) is not None:
                raise Fatal("a cache flush left the page accounting inconsistent") from error

    def plan(self, req: PlanRequest) -> Plan:
        kv = self.kv
        writes: list[RowWriteMsg] = []
        released: list[str] = []
        for rel in req.releases:
            kv.release(rel.rid, rel.computed_tokens, rel.session_id)
            released.append(rel.rid)
        for pub in req.publishes:
            kv.publish(pub.rid, pub.computed_tokens)
        for trim in req.trims:
            kv.trim(trim.rid, trim.keep_from_token)
        extended: list[str] = []
        extend_failed: list[str] = []
        for ext in req.extends:
            ext_writes = kv.extend(ext.rid, ext.total_tokens)
            if ext_writes is None:
                extend_failed.append(ext.rid)
            else:
                extended.append(ext.rid)
                writes.extend(RowWriteMsg(w.row, w.start, tuple(w.pages)) for w in ext_writes)
        admitted: list[Admitted] = []
        admit_failed: list[str] = []
        for adm in req.admits:
            got = None
            if not admit_failed:
                # A reuse limit: the prompt cut after it, so neither the tree's prefix nor a
                # session's keep covers more of it (KVCache.admit matches tokens[:-1])
                limit = adm.reuse_limit
                tokens = adm.tokens if limit is None else adm.tokens[: limit + 1]
                got = kv.admit(adm.rid, tokens, adm.reserve_tokens, adm.session_id)
            if got is None:
                admit_failed.append(adm.rid)
                continue
            pages = tuple(kv.row_pages(adm.rid)) if adm.export_pages else ()
            admitted.append(Admitted(adm.rid, got.row, got.num_cached_tokens, pages))
            writes.extend(RowWriteMsg(w.row, w.start, tuple(w.pages)) for w in got.writes)
        return Plan(
            req.step,
            tuple(released),
            tuple(extended),
            tuple(extend_failed),
            tuple(admitted),
            tuple(admit_failed),
            tuple(writes),
        )

    def check(self, loud: bool) -> OperationRefused | None:
        """Laws 3-4 (docs/architecture.md) when idle: nothing leaked, accounting closes. None,
        or the violation as the refusal a reply raises; loud: the AssertionError raised."""
        try:
            self.kv.check_integrity()
            stats = self.kv.stats()
            assert stats.free_rows == stats.total_rows, f"leaked rows: {stats}"
            assert stats.request_pages == 0, f"leaked request pages: {stats}"
            # Tree locks may remain only for sessions; check_integrity matched them up.
            if stats.sessions == 0:
                assert stats.locked_pages == 0, f"leaked tree locks: {stats}"
        except AssertionError as exc:
            log.error("integrity violation while idle: %s", exc)
            if loud:
                raise
            return OperationRefused(str(exc), "integrity_violation")
        return None
