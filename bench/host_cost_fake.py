"""The device work taken out of a running Engine, so that what bench/host_cost.py times is
shoal's host code. Nothing in shoal changes: `installed(...)` patches three seams of the
bench's own process (restored on exit), before the Engine starts:

- `DecoderModel.forward` -> `TrivialForward`: logits [S, V] from a table lookup. A fixed
  seeded table gives each token its next one (greedy follows it); the logits are 0 for every
  token that decodes to clean text on its own, -30 for the others (specials, lone bytes of a
  multi-byte character), and 1.0 at the table's pick, so sampled rows (top-p 0.9 keeps most of
  the vocabulary) draw clean tokens too and detokenizing costs what real text costs. Its own
  CPU time is counted apart (`forward_ns`): it stands for device work.
- `DeviceState.launch` -> counted (`StepCounter`): every launch, on the launch thread; the
  measuring window is a number of launches. The counting itself (~1 us a step) is not
  subtracted.
- graph path, no CUDA: `DeviceState.__init__` also builds `DecodeGraphs` without capturing
  (actors/executor/cuda_graphs.py: its documented CPU mode), so decode steps take the graph
  path's host code (buffers, padding, slot mapping) and its "replay" calls the trivial forward
  where a GPU would replay the graph. On CUDA the engine captures the trivial forward itself.

`FakeDevice` (`--device-ms N`), the device's time per forward, by path:

- cpu (`sync`): the forward sleeps N ms on the launch thread, as the CPU path's forward holds
  that thread (GIL released, as torch's kernels release it; a sleep, not a spin, so the
  2-core host keeps both cores for the host code, as a GPU's host would).
- graph without CUDA (`async`): a CUDA launch only queues; the host waits at the result copy.
  So the forward queues N ms on a virtual device timeline (starting when the previous step
  ends, or now if the device is idle) and returns at once; `StepStreams.to_host` (patched
  here) hands back a result whose wait sleeps until the step's end on that timeline, on the
  completion thread, as `HostResult.wait` sleeps in the CUDA event's synchronize.
- graph on CUDA (`cuda`): `torch.cuda._sleep` inside the forward, captured into the graphs:
  the GPU itself spins N ms. Busy is then estimated as steps * N / wall.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from shoal.actors.executor.device_state import DeviceState
from shoal.actors.executor.streams import HostResult, StepStreams
from shoal.actors.executor_messages import Launch
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.models.decoder import DecoderModel

REPLACEMENT_CHAR = "\ufffd"
PEAK_LOGIT = 1.0  # the table's pick: greedy takes it, sampling mostly does not
UNCLEAN_LOGIT = -30.0  # never drawn at temperature 0.7


def clean_ids(tokenizer: HFTokenizer, vocab_size: int) -> list[int]:
    """The ids that decode, alone, to text without U+FFFD: no specials, no lone bytes."""
    clean = []
    for i in range(vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=True)  # a special: ""
        if text and REPLACEMENT_CHAR not in text:
            clean.append(i)
    return clean


class FakeDevice:
    """The device's time per forward (module doc); `busy_s` over a window of wall time."""

    def __init__(self, device_ms: float, mode: str, device: torch.device) -> None:
        assert mode in ("sync", "async", "cuda"), mode
        self.step_s = device_ms / 1e3
        self.mode = mode
        self.free_at = 0.0  # async: when the virtual device finishes what is queued
        self.last_ready = 0.0  # async: the end of the latest queued step
        self.intervals: list[tuple[float, float]] = []  # sync, async: busy (start, end)
        self.cycles = 0
        if mode == "cuda" and device_ms > 0:
            self.cycles = round(device_ms * cuda_cycles_per_ms(device))

    def run(self) -> None:
        """One forward's device time (the launch thread)."""
        if self.step_s <= 0:
            return
        if self.mode == "sync":
            began = time.perf_counter()
            time.sleep(self.step_s)
            self.intervals.append((began, time.perf_counter()))
        elif self.mode == "async":
            start = max(time.perf_counter(), self.free_at)
            self.free_at = self.last_ready = start + self.step_s
            self.intervals.append((start, self.free_at))
        else:
            torch.cuda._sleep(self.cycles)

    def busy_s(self, began: float, ended: float, steps: int) -> float:
        """Device-busy seconds within [began, ended]."""
        if self.mode == "cuda":
            return min(ended - began, steps * self.step_s)  # an estimate (module doc)
        return sum(max(0.0, min(e, ended) - max(s, began)) for s, e in list(self.intervals))


def cuda_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per millisecond, measured once."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)


class FakeEvent:
    """What `HostResult.wait` synchronizes on in async mode: the step's end on the timeline."""

    def __init__(self, ready_at: float) -> None:
        self.ready_at = ready_at

    def synchronize(self) -> None:
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class TrivialForward:
    """The model's forward as a table lookup (module doc). Called on the launch thread only
    (and, on CUDA, while the graphs are captured)."""

    def __init__(
        self, clean: list[int], vocab_size: int, seed: int, fake: FakeDevice, device: torch.device
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        picks = torch.tensor(clean)[torch.randint(len(clean), (vocab_size,), generator=generator)]
        self.next_id = picks.to(device)  # [V]: each token's next
        base = torch.full((vocab_size,), UNCLEAN_LOGIT)
        base[clean] = 0.0
        self.base = base.to(device)  # [V]
        self.fake = fake
        self.forward_ns = 0  # its own CPU time, summed (read by the event loop at window edges)

    def __call__(  # set on the class: not bound, no `self` of the model's
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Any,
        kv: Any,
        sample_index: torch.Tensor,
    ) -> torch.Tensor:
        began = time.thread_time_ns()
        with torch.inference_mode():
            picks = self.next_id[input_ids[sample_index]]
            logits = self.base.expand(len(sample_index), -1).clone()
            logits.scatter_(1, picks.unsqueeze(1), PEAK_LOGIT)
        self.fake.run()
        self.forward_ns += time.thread_time_ns() - began
        return logits


class StepCounter:
    """Launches, counted on the launch thread; `arm` asks for the event loop to be told when
    `steps` more have launched. `off` counts launches that were not a decode of exactly
    `batch` rows (the window's steps must all be; host_cost_window.py checks)."""

    def __init__(self) -> None:
        self.launched = 0
        self.off = 0
        self.batch = 0
        self.target = -1
        self.lock = threading.Lock()
        self.tell: Callable[[], object] = lambda: None  # at the target, on the launch thread

    def arm(self, steps: int, batch: int, tell: Callable[[], object]) -> None:
        with self.lock:
            self.batch, self.target, self.tell = batch, self.launched + steps, tell

    def count(self, launch: Launch) -> None:
        with self.lock:
            self.launched += 1
            if len(launch.decode_rows) != self.batch or launch.seqs:  # not a steady step
                self.off += 1
            if self.launched == self.target:
                self.tell()


@contextlib.contextmanager
def installed(
    forward: TrivialForward, counter: StepCounter, graphs: tuple[int, int] | None
) -> Iterator[None]:
    """The patches of the module doc, for the block. `graphs`: (max batch, context length)
    of the CPU graph path's uncaptured DecodeGraphs; None for the CPU path and on CUDA."""
    fake = forward.fake
    launch = DeviceState.launch
    init = DeviceState.__init__
    to_host = StepStreams.to_host

    def counted_launch(state: DeviceState, msg: Launch) -> Any:
        counter.count(msg)
        return launch(state, msg)

    def init_with_graphs(state: DeviceState, *args: Any, **kwargs: Any) -> None:
        init(state, *args, **kwargs)
        if graphs is not None:
            from shoal.actors.executor.cuda_graphs import DecodeGraphs

            max_batch, context = graphs
            state.graphs = DecodeGraphs(
                state.model, state.kv, state.page_table, state.page_size, max_batch, context
            )

    def to_host_later(streams: StepStreams, tensors: tuple[torch.Tensor, ...]) -> HostResult:
        now = to_host(streams, tensors).wait()  # the CPU's: copied already
        return HostResult(now, FakeEvent(fake.last_ready))  # type: ignore[arg-type]

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(DecoderModel, "forward", forward))
        stack.enter_context(mock.patch.object(DeviceState, "launch", counted_launch))
        stack.enter_context(mock.patch.object(DeviceState, "__init__", init_with_graphs))
        if fake.mode == "async" and fake.step_s > 0:
            stack.enter_context(mock.patch.object(StepStreams, "to_host", to_host_later))
        yield
