"""Which waiting requests a plan admits (plain Python over the request table)."""

from __future__ import annotations

from shoal.actors.messages import AdmitReq
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.prefix_sharing import prefixes_in_progress
from shoal.actors.scheduler.request import Req
from shoal.actors.scheduler.request_table import RequestTable


def admissions(
    requests: RequestTable, holding: list[Req], num_released: int, budget: int, busy: bool
) -> list[AdmitReq]:
    """Admissions in queue order within max_running and the step's prefill budget of prompt
    tokens (`busy`: the step launches something else; if not, one is admitted however long).
    A request whose long prefix another is computing now waits (prefix_sharing.py); that
    bookkeeping runs only when something waits."""
    config = requests.config
    admits: list[AdmitReq] = []
    if not requests.waiting:
        return admits
    computing = prefixes_in_progress(holding, config)
    num_holding = len(holding) - num_released
    for rid in requests.waiting:
        if num_holding + len(admits) >= config.max_running:
            break
        req = requests.reqs[rid]
        if budget <= 0 and (admits or busy):
            break
        if computing is not None and req.session_id is None and req.role != "receive":
            if computing.should_wait(req.tokens):
                continue  # admitted once the shared prefix is in the tree
            computing.add(req.tokens, 0)
        reserve = transfers.reserve_tokens(req)
        exports = req.role is not None
        admits.append(
            AdmitReq(rid, tuple(req.tokens), reserve, req.session_id, exports, req.reuse_limit)
        )
        budget -= min(len(req.tokens), config.chunk_size)
    return admits
