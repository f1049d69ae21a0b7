"""The decoder forward every family shares, over a paged KV cache.

`DecoderModel.forward` takes a ragged batch of new tokens, stores their K/V into the pool and
returns logits only for the tokens that sample. The step's attention (prepared by a backend from
the batch) is an argument. What differs between families is read from the ModelConfig (per-layer
sliding windows, q/k norms, Gemma's norms around attention and the MLP, its scaled embedding and
soft-capping, partial RoPE, experts) and from the family's `ModelSource` mapping (layout.py).

One layer, as transformers computes it (Gemma's extra norms in brackets)::

    x = norm(h)                          (fused with the previous layer's residual add)
    q, k, v = split(qkv(x));  [q, k = q_norm(q), k_norm(k)];  q, k = rope(q, k)
    a = o(attend(q, k, v, window, softcap));  [a = post_attention_norm(a)]
    h = h + a;  x = norm(h)              (fused: add_rms_norm)
    m = mlp(x) or experts(x);  [m = post_mlp_norm(m)]
    h = h + m
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.kernels.attention import AttentionMetadata
from shoal.kernels.batch import Attention
from shoal.kernels.elementwise import Elementwise, TorchElementwise
from shoal.kernels.linear import LinearKind
from shoal.kernels.moe import Experts
from shoal.kernels.rope import apply_rope, rope_tables
from shoal.kernels.routed_experts import Recorder
from shoal.loading.config import ModelConfig
from shoal.models.dense_mlp import dense_mlp
from shoal.models.fused_layers import FusedLayers, fused_layers
from shoal.models.kv_pool import KVPool
from shoal.models.layout import ModelSource, Part, part_of
from shoal.models.weights import (
    LayerWeights,
    ModelWeights,
    StagedWeights,
    build_weights,
    expert_weights,
    linear_weights,
    plain_tensors,
)

# A family's mapping from a full set of HF-named weights to the forward's layout.
SourceFn = Callable[[ModelConfig, dict[str, torch.Tensor]], ModelSource]


class DecoderModel:
    fused: FusedLayers | None  # a step of decodes through the C++ layers (fused_layers.py)

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        linear_kind: LinearKind = "dense",
        elementwise: Elementwise | None = None,
        *,
        source: SourceFn,
        part: Part | None = None,
        f32_many_rows: int | None = None,
    ) -> None:
        self.config = config
        # from how many rows float32 panel linears take oneDNN (kernels/f32_many_rows.py);
        # None: the first build measures it
        self.f32_many_rows = f32_many_rows
        self.part = part or Part.whole(config.num_layers)
        self.dtype = dtype
        self.device = device
        self.linear_kind = linear_kind
        self.elementwise = elementwise or TorchElementwise()
        self.source = source
        self.scale = config.query_scale or config.head_dim**-0.5
        self.windows = config.layer_windows or (None,) * config.num_layers
        # One cos/sin table per distinct RoPE; each layer reads one (Gemma 3: sliding layers
        # have their own). In the model's dtype, as transformers casts them before rotating.
        ropes = [(config.rope_theta, config.rope_scaling)]
        if config.sliding_rope is not None:
            ropes.append(config.sliding_rope)
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for theta, scaling in ropes:
            rotary = config.rotary_dim or config.head_dim
            cos, sin = rope_tables(rotary, theta, scaling, config.max_position_embeddings)
            self.tables.append((cos.to(device=device, dtype=dtype), sin.to(device, dtype)))
        self.table_of_layer = [int(w is not None) * (len(ropes) - 1) for w in self.windows]
        self.embed_scale = None
        if config.embed_scale is not None:
            self.embed_scale = torch.tensor(config.embed_scale, dtype=dtype, device=device)
        self.load(weights)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Take a full set of HF-named weights (already checked for names and shapes): the
        first load builds; a later one is a weight update, `commit(stage(weights))`."""
        if not hasattr(self, "weights"):
            source = part_of(self.source(self.config, weights), self.part)
            self.weights = build_weights(
                self.config, source, self.dtype, self.device, self.linear_kind, self.f32_many_rows
            )
            self.f32_many_rows = self.weights.f32_many_rows  # kept for every later build
            self.fused = self._fused(self.weights)
        else:
            self.commit(self.stage(weights))

    @property
    def released(self) -> bool:
        """Its weights were released (`release_weights`) and not loaded since."""
        return not hasattr(self, "weights")

    def release_weights(self) -> None:
        """Drop the serving weights (release_memory_occupation): nothing runs the forward
        until `load` builds them again, as the first load does."""
        if not self.released:
            del self.weights
            self.fused = None

    def stage(self, weights: dict[str, torch.Tensor]) -> StagedWeights:
        """Everything of a weight update that can fail (mapping, packing, quantizing),
        done beside the serving weights, which it leaves as they are. A pipeline stages every
        part before it commits any, so a failure anywhere leaves the old weights everywhere.

        Packed and int8 linears (CPU) are built anew: for a moment the old and the new packed
        weights are both held. Dense ones (CUDA, and the reference) are copied into in place
        at the commit (`copy_` casts), since a captured CUDA graph reads those very tensors;
        here they are only mapped to the forward's layout."""
        source = part_of(self.source(self.config, weights), self.part)
        if self.linear_kind != "dense":
            built = build_weights(
                self.config, source, self.dtype, self.device, self.linear_kind, self.f32_many_rows
            )
            return StagedWeights(rebuilt=built, fused=self._fused(built))
        experts = [(moe.router, moe.gate_up, moe.down) for moe in expert_weights(source)]
        return StagedWeights(
            plain=plain_tensors(self.config, source),
            linears=linear_weights(source),
            experts=experts,
        )

    def commit(self, staged: StagedWeights) -> None:
        """Serve staged weights: swap them in, or copy them into the tensors in place (which
        fails only if the device does)."""
        if staged.rebuilt is not None:
            self.weights, self.fused = staged.rebuilt, staged.fused
            return
        own = self.weights
        for old, new in zip(own.tensors(), staged.plain, strict=True):
            old.copy_(new)
        for linear, (weight, bias) in zip(own.linears(), staged.linears, strict=True):
            linear.load(weight, bias)
        for experts, (router, gate_up, down) in zip(own.experts(), staged.experts, strict=True):
            experts.load(router, gate_up, down)

    def _fused(self, weights: ModelWeights) -> FusedLayers | None:
        part_windows = self.windows[self.part.layers.start : self.part.layers.stop]
        return fused_layers(self.config, weights.layers, part_windows, self.elementwise, self.scale)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        kv: KVPool,
        sample_index: torch.Tensor,
    ) -> torch.Tensor:
        """The whole model: input_ids, positions: [T]; sample_index: [S] rows of T that
        sample. Returns [S, V]."""
        h = self.embed(input_ids)
        h = self.run_layers(h, positions, attention, kv)
        return self.head(h, sample_index)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first part's start: [T] ids -> [T, hidden]."""
        assert self.weights.embed is not None, "only the first pipeline stage embeds"
        h = F.embedding(input_ids, self.weights.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        return h

    @torch.inference_mode()
    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        kv: KVPool,
        recorder: Recorder = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        """This part's layers over the residual stream h [T, hidden]; `kv` holds exactly
        their K/V (a stage's pool, in order). `recorder` takes each MoE layer's top-k ids
        (kernels/routed_experts.py); a recording batch runs the layer loop, never fused.
        `rows`: the rows the step stands for (BatchShape.kernel_rows; None: its T)."""
        cfg = self.config
        ops = self.elementwise
        eps = cfg.rms_norm_eps
        layers = self.weights.layers
        rotations = [(cos[positions], sin[positions]) for cos, sin in self.tables]
        fused = self.fused
        if recorder is None and fused is not None and fused.takes(attention, int(h.shape[0]), rows):
            assert isinstance(attention, AttentionMetadata)
            return fused(h, *rotations[0], attention, kv, rows)
        first = self.part.layers.start
        x = ops.rms_norm(h, layers[0].norms.input, eps)
        for layer_id, layer in enumerate(layers):
            cos, sin = rotations[self.table_of_layer[first + layer_id]]
            window = self.windows[first + layer_id]
            attn = self._attend(layer, x, cos, sin, attention, kv, layer_id, window, rows)
            norms = layer.norms
            if norms.pre_mlp is not None and norms.post_mlp is not None:
                h = h + ops.rms_norm(attn, norms.post_attention, eps)
                x = ops.rms_norm(h, norms.pre_mlp, eps)
                mlp = self._mlp(layer, x, recorder, first + layer_id, rows)
                mlp = ops.rms_norm(mlp, norms.post_mlp, eps)
            else:
                h, x = ops.add_rms_norm(h, attn, norms.post_attention, eps)
                mlp = self._mlp(layer, x, recorder, first + layer_id, rows)
            if layer_id + 1 < len(layers):  # the residual add, fused with the next layer's norm
                h, x = ops.add_rms_norm(h, mlp, layers[layer_id + 1].norms.input, eps)
            else:
                h = h + mlp
        return h

    @torch.inference_mode()
    def head(
        self, h: torch.Tensor, sample_index: torch.Tensor, rows: int | None = None
    ) -> torch.Tensor:
        """The last part's end: the rows of h that sample -> float32 logits [S, V]; `rows`: as
        many as it stands for (run_layers: a verification's places are its row's one)."""
        cfg = self.config
        weights = self.weights
        assert weights.norm is not None and weights.lm_head is not None, "the last stage only"
        last = self.elementwise.rms_norm(h[sample_index], weights.norm, cfg.rms_norm_eps)
        logits = weights.lm_head(last, rows)
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def _attend(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        kv: KVPool,
        layer_id: int,
        window: int | None,
        rows: int | None,
    ) -> torch.Tensor:
        """The attention block up to and including o_proj: [T, hidden]. layer_id: the layer's
        place in this part (and in `kv`)."""
        cfg = self.config
        ops = self.elementwise
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        qkv = layer.qkv(x, rows)
        qk = qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, dim)
        norms = layer.norms
        if norms.q is not None and norms.k is not None:
            eps = cfg.rms_norm_eps
            q = ops.rms_norm(qk[:, :heads].reshape(-1, dim), norms.q, eps).view(-1, heads, dim)
            k = ops.rms_norm(qk[:, heads:].reshape(-1, dim), norms.k, eps).view(-1, kv_heads, dim)
            qk = torch.cat([q, k], dim=1)
        rotary = cfg.rotary_dim or dim
        if rotary == dim:
            qk = ops.rope(qk, cos, sin)  # q and k rotate together: [T, H + Hkv, D] in one pass
        else:  # partial RoPE: the leading dims rotate, the rest pass through
            qk = torch.cat([apply_rope(qk[..., :rotary], cos, sin), qk[..., rotary:]], dim=-1)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, kv_heads, dim)
        k_cache, v_cache = kv.k[layer_id], kv.v[layer_id]
        attention.store(k_cache, v_cache, k, v)
        if window is None and cfg.attn_softcap is None:
            out = attention.attend(q, k_cache, v_cache, self.scale)
        else:
            out = attention.attend(
                q, k_cache, v_cache, self.scale, window=window, softcap=cfg.attn_softcap
            )
        return layer.o(out.reshape(-1, q_size), rows)

    def _mlp(
        self, layer: LayerWeights, x: torch.Tensor, rec: Recorder, n: int, rows: int | None
    ) -> torch.Tensor:
        """`rec` records the experts of the model's layer `n` (kernels/routed_experts.py)."""
        mlp = layer.mlp
        if isinstance(mlp, Experts):
            return mlp(x) if rec is None else rec.run(mlp, x, n)
        return dense_mlp(mlp, x, self.elementwise, self.config.activation, rows)
