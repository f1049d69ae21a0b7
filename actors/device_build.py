"""What an engine's start builds off the event loop, in a thread that ends with it
(api/fresh_thread.py): the model in its pipeline stages, each on its device with its K/V pool,
attention backend and stream, and the executor's device state over them. All of it is torch
work, which must not run on the loop's thread (an OpenMP team left there slows the CPU forward
2x); `start_actors` (wiring.py) takes the result."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.actors.executor.device_state import DeviceState
from shoal.actors.executor.stages import Stage, split_layers, stage_devices
from shoal.actors.executor.streams import StepStreams
from shoal.config import EngineOptions
from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import AttentionBackend
from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.elementwise import CompiledElementwise
from shoal.kernels.grammars import Grammars
from shoal.loading.identity import weights_digest
from shoal.models.kv_pool import KVPool
from shoal.models.layout import Part
from shoal.models.load import LoadedModel
from shoal.models.prompt_cost import prompt_token_ms
from shoal.models.registry import family_of
from shoal.resolve_options import Resolved


@dataclass(frozen=True)
class Built:
    """What the start builds off the event loop, in a thread of its own (api/fresh_thread.py):
    the models on their devices with their KV pools, and the executor's device state;
    `prompt_token_ms`: a prompt token's matmuls, measured where the CPU's mixed-prefill cap is
    the engine's to pick (`Resolved.cap_to_measure`; models/prompt_cost.py; None: not
    measured); `f32_many_rows`: from how many rows float32's linears take oneDNN, as the
    first stage's build measured it (kernels/f32_many_rows.py; None: not float32 panels)."""

    stages: list[Stage]
    grammars: Grammars
    device_state: DeviceState
    prompt_token_ms: float | None = None
    f32_many_rows: int | None = None


def build_device(
    loaded: LoadedModel, options: EngineOptions, resolved: Resolved, kernels: CpuKernels | None
) -> Built:
    layout = resolved.cache
    config = loaded.config
    compiled = kernels if resolved.attention == "cpu" else None  # int8 may load them alone
    stages = build_stages(loaded, options, resolved, compiled)
    grammars = Grammars(
        loaded.tokenizer,
        config.vocab_size,
        config.eos_token_ids,
        options.grammar_cache_mb << 20,
        options.json_any_whitespace,
    )
    first = stages[0]
    device_state = DeviceState(
        first.model,
        first.kv,
        first.attention,
        layout.num_rows,
        layout.max_pages_per_row,
        layout.page_size,
        config.eos_token_ids,
        later_stages=stages[1:],
        streams=first.streams,
        weights_digest=weights_digest(loaded.weights, resolved.linear_kind),
        folder=loaded.path,
        grammars=grammars,
    )
    cost = prompt_token_ms([stage.model for stage in stages]) if resolved.cap_to_measure else None
    many = stages[0].model.f32_many_rows if resolved.linear_kind == "packed" else None
    return Built(stages, grammars, device_state, cost, many)


def attention_backend(
    name: str, page_size: int, num_kv_heads: int, kernels: CpuKernels | None
) -> AttentionBackend:
    if name == "triton":
        from shoal.kernels.triton.attention import TritonAttention  # needs the triton package

        return TritonAttention(page_size, num_kv_heads)
    if kernels is None:
        return TorchAttention(page_size)
    return TorchAttention(page_size, kernels.paged_decode, kernels.store_kv, kernels.paged_extend)


def build_stages(
    loaded: LoadedModel, options: EngineOptions, resolved: Resolved, compiled: CpuKernels | None
) -> list[Stage]:
    """The model in `pipeline_stages` parts (one: the whole model), each with its K/V pool,
    attention backend and stream on its device (actors/executor/stages.py)."""
    config = loaded.config
    layout = resolved.cache
    count = options.pipeline_stages
    parts = split_layers(config.num_layers, count, options.stage_layers)
    devices = stage_devices(count, options.stage_devices, resolved.device)
    family = family_of(config.model_type)
    slots = layout.num_pages * layout.page_size
    stages: list[Stage] = []
    for k, (layers, device) in enumerate(zip(parts, devices, strict=True)):
        part = Part(layers, first=k == 0, last=k == count - 1)
        model = family.build(
            config,
            loaded.weights,
            resolved.dtype,
            device,
            resolved.linear_kind,
            None if compiled is None else CompiledElementwise(compiled),
            part=part,
            # the first stage measures float32's kernels (kernels/f32_many_rows.py), the rest
            # take its choice
            f32_many_rows=stages[0].model.f32_many_rows if stages else None,
        )
        pool = KVPool(config, slots, resolved.kv_dtype, device, num_layers=len(layers))
        backend = attention_backend(
            resolved.attention, layout.page_size, config.num_kv_heads, compiled
        )
        stages.append(Stage(model, pool, backend, StepStreams(device)))
    return stages
