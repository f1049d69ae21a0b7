"""An Engine's start, in order (docs/architecture.md, "Start-up and the cache"):

    loaded    = load_model(model)        off the event loop; a LoadedModel given is used as is
    resolved  = resolve(options, ...)    the context, the KV pool's size (memory.py on CUDA)
    kernels   = cpu_kernels(...)         off the loop: they may compile
    built     = build_device(...)        the models on their devices, their KV pools, the
                                         executor's device state (actors/device_build.py);
                                         on the CPU a prompt token's cost, measured, which
                                         sets the mixed-prefill cap when it is unset
    actors    = start_actors(...)        the four (five) actors' tasks (actors/wiring.py)
    bootstrap = BootstrapServer(...)     a prefill server's endpoint (disaggregation)
    loaded.weights.clear(); trim_host_heap()   the read copies are the model's now

The work off the loop runs in threads that end with it (fresh_thread.py: an OpenMP team left
behind in a thread that lives on halves the CPU forward's speed).

`cancel` (Engine.cancel_start) is read by the load and the kernel build, which stop at their
next check and remove what they were writing (StartCancelled); nothing is running before the
actors start, so nothing needs stopping then. A bootstrap endpoint that cannot listen stops the
actors again and fails the start with ValueError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shoal.actors.device_build import build_device
from shoal.actors.disagg_wiring import room_handlers
from shoal.actors.supervise import FaultInjector
from shoal.actors.wiring import Actors, start_actors
from shoal.api.fresh_thread import in_fresh_thread
from shoal.api.http.bootstrap_listener import listener_rules
from shoal.config import EngineOptions
from shoal.disagg.backend import LocalFabric
from shoal.disagg.bootstrap import BootstrapServer
from shoal.heap import trim_host_heap
from shoal.kernels.cache_files import raise_if_cancelled
from shoal.kernels.cpu_kernels import CpuKernels, KernelUnavailable, load_cpu_kernels
from shoal.loading.loader import default_cache_dir
from shoal.memory import DeviceMemory, measure_device_memory
from shoal.models.load import LoadedModel, load_model
from shoal.resolve_options import Resolved, resolve, resolve_device

log = logging.getLogger("shoal")


@dataclass(frozen=True)
class Started:
    loaded: LoadedModel
    resolved: Resolved
    attention: str  # the attention backend in use: torch, triton or cpu
    actors: Actors
    bootstrap: BootstrapServer | None  # a prefill server's endpoint
    startup_s: float


@dataclass(frozen=True)
class StartHooks:
    """What the Engine hands its start beside the model and the options."""

    on_death: Callable[[str], None]  # an actor ended the engine: the reason /health reports
    faults: FaultInjector  # the tests' seam (api/testing.py), shared by every actor
    cancel: threading.Event  # set by Engine.cancel_start
    fabric: LocalFabric | None = None  # disaggregation's "local" transfer backend
    peer_key: str | None = None  # the key of the bootstrap calls between servers


async def start_engine(
    model: str | Path | LoadedModel | None, options: EngineOptions, hooks: StartHooks
) -> Started:
    began = time.perf_counter()
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    if isinstance(model, LoadedModel):
        loaded = model
    else:
        _, dtype = resolve_device(options)
        loaded = await in_fresh_thread(load_model, model, dtype=dtype, cancel=hooks.cancel)
    resolved = resolve(
        options,
        loaded.config.max_position_embeddings,
        device_memory(options, loaded),
        has_experts=loaded.config.moe is not None,
    )
    kernels = await in_fresh_thread(  # the CPU kernels may compile: off the loop
        cpu_kernels, resolved, default_cache_dir(), options.attention, hooks.cancel
    )
    raise_if_cancelled(hooks.cancel)  # nothing is running yet: nothing to stop
    fell_back = resolved.attention == "cpu" and kernels is None
    built = await in_fresh_thread(build_device, loaded, options, resolved, kernels)
    if built.prompt_token_ms is not None:  # the CPU's cap, unset: from the measured cost
        resolved = resolved.with_measured_cap(built.prompt_token_ms)
    resolved = replace(resolved, f32_many_rows=built.f32_many_rows)  # as the build measured
    actors = start_actors(
        loaded,
        options,
        resolved,
        built,
        hooks.on_death,
        hooks.faults,
        hooks.fabric,
        hooks.peer_key,
    )
    bootstrap = None
    if options.disaggregation_mode == "prefill":
        bootstrap = await listen(actors, options, hooks.peer_key)
    if loaded is not model:
        loaded.weights.clear()  # the model holds its own copies; a caller's stay whole
        trim_host_heap()  # the read copies are freed: give their pages back (heap.py)
    return Started(
        loaded,
        resolved,
        "torch" if fell_back else resolved.attention,
        actors,
        bootstrap,
        time.perf_counter() - began,
    )


async def listen(actors: Actors, options: EngineOptions, peer_key: str | None) -> BootstrapServer:
    """A prefill server's bootstrap endpoint, listening (the HTTP app's limits, errors and
    key); if it cannot, the actors stop again and the start fails with ValueError."""
    assert actors.transfer_box is not None
    server = BootstrapServer(
        room_handlers(actors.transfer_box),
        options.disaggregation_bootstrap_host,
        options.disaggregation_bootstrap_port,
        listener_rules(peer_key),
    )
    try:
        await server.start()
    except OSError as exc:
        await actors.stop()
        raise ValueError(f"the bootstrap endpoint could not listen: {exc}") from exc
    return server


def device_memory(options: EngineOptions, loaded: LoadedModel) -> DeviceMemory | None:
    """What sizes the KV pool on CUDA when kv_cache_tokens is unset (memory.py); None
    otherwise."""
    device, dtype = resolve_device(options)
    if device.type != "cuda" or options.kv_cache_tokens is not None:
        return None
    num_weights = sum(t.numel() for t in loaded.weights.values())
    return measure_device_memory(loaded.config, options, num_weights, dtype, device)


def cpu_kernels(
    resolved: Resolved, cache_dir: Path, asked_attention: str, cancel: threading.Event | None = None
) -> CpuKernels | None:
    """The compiled CPU kernels when the resolved attention is "cpu" or the linears are int8
    (built on first use; StartCancelled if `cancel` is set meanwhile). When they cannot be
    built, int8 and an explicit `attention="cpu"` fail the start, and "auto" falls back to the
    torch reference with a warning."""
    wanted = resolved.attention == "cpu" or resolved.linear_kind == "int8"
    if not wanted:
        return None
    try:
        return load_cpu_kernels(cache_dir, cancel)
    except KernelUnavailable as error:
        if resolved.linear_kind == "int8":
            raise ValueError(f"quantization int8: {error}") from error
        if asked_attention == "cpu":
            raise ValueError(f"attention cpu: {error}") from error
        log.warning("%s; the torch reference runs instead (attention=torch)", error)
        return None
