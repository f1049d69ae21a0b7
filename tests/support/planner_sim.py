"""A scheduler's planning loop without asyncio: the planner driven with the real KVCache and
cache manager and a fake device (tests/actors/scheduler)."""

from __future__ import annotations

from collections import deque

from shoal.actors.cache_manager.cache_manager import CacheManager
from shoal.actors.executor_messages import Launch
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Admit, Output, StepDone
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.request import PlannerConfig
from shoal.actors.scheduler.speculation import SpecConfig
from shoal.cache.kv import KVCache
from shoal.params import SamplingParams

EOS = 2


class FakeDevice:
    """Next token = a hash of (position, input token); the 'model' never looks further back,
    so a request's tokens do not depend on batching, chunking or retraction. `counting`: the
    next token is the input's successor in a cycle of 50 ids (3 .. 52), whatever the
    position, so a prompt holding the cycle has every n-gram draft kept. A speculating decode
    (SeqChunk.num_drafts) is verified greedily: its drafts kept while each is the token its
    input before gives, then one more (StepDone.drafted)."""

    def __init__(self, counting: bool = False) -> None:
        self.last_token: dict[int, int] = {}
        self.rows_read: list[set[int]] = []
        self.counting = counting

    def next(self, last: int, pos: int) -> int:
        if self.counting:
            return (last - 3 + 1) % 50 + 3
        return (last * 31 + pos * 7) % 89 + 3

    def run(self, launch: Launch) -> StepDone:
        out = []
        drafted: list[tuple[int, tuple[int, ...]]] = []
        self.rows_read.append({s.row for s in launch.all_seqs()})
        for seq in launch.all_seqs():
            if seq.num_drafts:
                assert seq.input_ids is not None
                kept: list[int] = []
                for j, draft in enumerate(seq.input_ids[1:]):
                    if self.next(seq.input_ids[j], seq.start + j) != draft:
                        break
                    kept.append(draft)
                last, pos = seq.input_ids[len(kept)], seq.start + len(kept)
                if kept:
                    drafted.append((len(out), tuple(kept)))
            elif seq.input_ids is None:
                last, pos = self.last_token[seq.row], seq.start
            else:
                last, pos = seq.input_ids[-1], seq.start + seq.num_tokens - 1
            if seq.sample:
                token = self.next(last, pos)
                self.last_token[seq.row] = token
                out.append(token)
        return StepDone(launch.batch_id, tuple(out), drafted=tuple(drafted))


class Sim:
    def __init__(
        self,
        *,
        num_pages: int = 64,
        page_size: int = 4,
        num_rows: int = 8,
        chunk_size: int = 64,
        max_inflight: int = 2,
        eos: tuple[int, ...] = (EOS,),
        max_mixed_prefill_tokens: int = 0,
        speculative: SpecConfig | None = None,
        counting: bool = False,
    ) -> None:
        self.kv = KVCache(
            num_pages=num_pages, page_size=page_size, num_rows=num_rows, max_pages_per_row=64
        )
        self.cache = CacheManager(self.kv, Mailbox("c"), Mailbox("s"), strict=True)
        self.planner = Planner(
            PlannerConfig(
                num_rows,
                chunk_size,
                256,
                eos,
                max_mixed_prefill_tokens=max_mixed_prefill_tokens,
                page_size=page_size,
                speculative=speculative,
            )
        )
        self.device = FakeDevice(counting)
        self.max_inflight = max_inflight
        self.launched: deque[Launch] = deque()
        self.outputs: dict[str, list[Output]] = {}
        self.released: list[str] = []
        self.step_no = 0
        self.last_launch: Launch | None = None

    def add(self, rid: str, prompt: list[int], **sampling: object) -> None:
        params = SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
        self.planner.add(Admit(rid, tuple(prompt), params, 0))

    def record(self, outputs: list[Output]) -> None:
        for rids, tokens in self.planner.take_steady():  # a steady step's, as columns
            for rid, token in zip(rids, tokens, strict=True):
                self.outputs.setdefault(rid, []).append(Output(rid, (token,)))
        for out in outputs + self.planner.take_errors():
            self.outputs.setdefault(out.rid, []).append(out)
        self.released += self.planner.take_released()

    def plan_and_launch(self) -> bool:
        """One scheduler round trip up to the launch. False if nothing was planned."""
        request = self.planner.propose(self.step_no)
        if request is None:
            return False
        self.step_no += 1
        launch = self.planner.apply_plan(self.cache.plan(request))
        self.record([])
        self.last_launch = launch
        if launch is not None:
            self.launched.append(launch)
        return True

    def complete_one(self) -> None:
        self.record(self.planner.process(self.device.run(self.launched.popleft())))

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.planner.idle:
                break
            if len(self.launched) < self.max_inflight and self.plan_and_launch():
                continue
            assert self.launched, f"stuck: {self.planner.snapshot()}"
            self.complete_one()
        assert self.planner.idle
        assert self.cache.check(loud=True) is None

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.token_ids]

    def finish(self, rid: str) -> str | None:
        return self.outputs[rid][-1].finish


def solo(prompt: list[int], counting: bool = False, **sampling: object) -> list[int]:
    sim = Sim(max_inflight=1, counting=counting)
    sim.add("solo", prompt, **sampling)
    sim.run()
    return sim.tokens("solo")
