"""A one-stage step's logits, made the cheapest way its asks allow (`DeviceState._launch`):

    out = step_logits(model, attention, page_table, kv, graphs, step, asks, routed, drafts)

- a decode graph replays (cuda_graphs.py) when every entry of the batch is one token and no
  prompt logprobs or routed experts ask for the layers' hidden states: plain decodes get
  their logits as they are, and speculating decodes (one entry a position:
  step_inputs._shape) every entry's, the drafts' places' and the sampling places' taken
  from them;
- eagerly, one head over the drafts' places and the sampling places, when prompt logprobs
  (from the same hidden states), routed experts (recorded by the layer loop) or drafts that
  no graph holds ask for more than the sampled logits;
- else the model's forward (on the CPU, the fused decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from shoal.actors.executor.draft_asks import DraftAsks
from shoal.actors.executor.prompt_asks import PromptAsks
from shoal.actors.executor.routed_asks import RoutedAsks
from shoal.actors.executor.step_inputs import StepInputs, token_rows
from shoal.kernels.batch import AttentionBackend
from shoal.kernels.logprob_gather import LogprobColumns, sliced_logprobs
from shoal.models.decoder import DecoderModel
from shoal.models.kv_pool import KVPool

if TYPE_CHECKING:
    from shoal.actors.executor.cuda_graphs import DecodeGraphs  # imports triton


class StepLogits(NamedTuple):
    logits: torch.Tensor  # [S, V]: the sampling places'
    # [D + S, V] when drafts verify: the drafts' places' (drafts.places), then `logits` (its
    # tail: one tensor, no copy to join them; draft_asks.py)
    verified: torch.Tensor | None = None
    prompt: LogprobColumns | None = None  # the asked prompt positions' logprobs
    experts: torch.Tensor | None = None  # the routed places' expert ids


def step_logits(
    model: DecoderModel,
    attention: AttentionBackend,
    page_table: torch.Tensor,
    kv: KVPool,
    graphs: DecodeGraphs | None,
    step: StepInputs,
    asks: PromptAsks | None,
    routed: RoutedAsks | None,
    drafts: DraftAsks | None,
) -> StepLogits:
    num_sampling = len(step.sample_rows_host)
    shape = step.shape
    replays = asks is None and routed is None and graphs is not None and graphs.fits_tokens(shape)
    if replays and drafts is not None:
        assert graphs is not None
        every = graphs.run(step.ids, step.positions, token_rows(shape, step.ids.device))
        verified = every.index_select(0, torch.cat((drafts.places, step.sample_index)))
        return StepLogits(verified[len(drafts.places) :], verified)
    if replays and drafts is None and num_sampling == len(shape.rows):
        assert graphs is not None
        return StepLogits(graphs.run(step.ids, step.positions, step.sample_rows))
    prepared = attention.prepare(page_table, shape)
    if asks is None and routed is None and drafts is None:
        return StepLogits(model.forward(step.ids, step.positions, prepared, kv, step.sample_index))
    recorder = None
    if routed is not None:
        assert model.config.moe is not None
        recorder = routed.recorder(model.config.num_layers, model.config.moe.top_k)
    h = model.run_layers(
        model.embed(step.ids), step.positions, prepared, kv, recorder, shape.kernel_rows()
    )
    both = None
    if drafts is None:
        logits = model.head(h, step.sample_index)
    else:  # the head stands for the S sampling rows (a verification is its row's one decode)
        both = model.head(h, torch.cat((drafts.places, step.sample_index)), num_sampling)
        logits = both[len(drafts.places) :]
    prompt = prompt_logprobs(model, h, asks) if asks is not None else None
    experts = recorder.ids() if recorder is not None else None
    return StepLogits(logits, both, prompt, experts)


def prompt_logprobs(model: DecoderModel, h: torch.Tensor, asks: PromptAsks) -> LogprobColumns:
    """The asked prompt positions' logprobs, the head run on slices of h (never the whole
    prompt's logits at once: logprob_gather.py)."""
    return sliced_logprobs(
        lambda places: model.head(h, places),
        asks.index,
        asks.targets,
        asks.top_k,
        asks.listed,
        model.config.vocab_size,
    )
