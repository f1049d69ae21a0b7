"""A weight update as the executor carries it out, on its launch thread while nothing is in
flight (docs/architecture.md, "Weight updates, cache flush and pause"): the new weights read
(a checkpoint folder) or checked (tensors by Hugging Face name), validated whole, staged
beside the serving weights in every pipeline stage and only then committed in all of them, so
a refusal or a failure partway leaves the old weights everywhere, never a mix.

An update from tensors may name any subset of the model's tensors (a trainer sends them in
buckets); the others keep their values. Staging builds from the whole set by name, so after
the first update from tensors the executor keeps that set on the host (`host`): one copy of
the model in its dtype, replaced by each later push and dropped by an update from disk, whose
folder is the whole set again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shoal.actors.executor.streams import StepStreams
from shoal.actors.writer_messages import DiskWeights, WeightSource
from shoal.loading.checkpoint import CheckpointError
from shoal.loading.identity import weights_digest
from shoal.loading.loader import checkpoint_folder
from shoal.loading.weights import check_finite
from shoal.models.decoder import DecoderModel
from shoal.models.load import expected_weight_shapes, load_weights, read_model_config
from shoal.results import OperationRefused

log = logging.getLogger("shoal.executor")

# Tensors a trainer's state dict may carry that the forward never reads (as a checkpoint's).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ServingWeights:
    """Where the serving weights came from, and the one way to replace them."""

    def __init__(
        self, models: list[DecoderModel], streams: StepStreams, folder: Path | None
    ) -> None:
        """`models`: every pipeline stage's part (one without stages); `folder`: the
        checkpoint the serving weights were read from (None: built from tensors)."""
        self.models = models
        self.streams = streams
        self.folder = folder
        self.host: dict[str, torch.Tensor] | None = None

    def load(self, source: WeightSource) -> str:
        """Serve `source`'s weights; their digest (loading/identity.py). OperationRefused
        (invalid_checkpoint) saying why they were refused, the old weights serving on. No other
        exception escapes: whatever a checkpoint or a trainer sends, the executor lives. The
        reason is for the client (no paths of ours); the log has the detail."""
        if any(model.released for model in self.models):
            why = "the weights are released: resume them (tags weights) before an update"
            raise OperationRefused(why, "invalid_checkpoint")
        try:
            if isinstance(source, DiskWeights):
                folder = checkpoint_folder(source.model_path)
                digest = self._serve(self._read(folder))
                self.folder, self.host = folder, None
            else:
                weights = self._with(self._checked(source.named))
                digest = self._serve(weights)
                self.host = weights
            return digest
        except CheckpointError as exc:
            log.warning("refused new weights (%s): %s", source.describe(), exc)  # no traceback
            raise OperationRefused(f"{_refused(source)}: {exc}", "invalid_checkpoint") from None
        except OperationRefused:
            raise
        except Exception:
            log.exception("loading new weights (%s) failed", source.describe())
            raise OperationRefused(_unreadable(source), "invalid_checkpoint") from None

    def whole(self) -> dict[str, torch.Tensor]:
        """The serving weights by name, to build them again after a release: the host copy
        of the last push, or the checkpoint they were read from."""
        if self.host is not None:
            return self.host
        assert self.folder is not None, "built from tensors, the host copy is kept"
        return self._read(self.folder)

    def _read(self, folder: Path) -> dict[str, torch.Tensor]:
        config = self.models[0].config
        other = read_model_config(folder)
        if other.architecture() != config.architecture():
            raise OperationRefused(
                "the checkpoint has a different architecture: "
                f"{other.architecture()} instead of {config.architecture()}",
                "invalid_checkpoint",
            )
        return load_weights(folder, config, dtype=self.models[0].dtype)

    def _checked(self, named: tuple[tuple[str, torch.Tensor], ...]) -> dict[str, torch.Tensor]:
        """The pushed tensors by name, each known, of its shape, floating point, finite once
        cast to the model's dtype, and copied to the host (the caller may reuse its own)."""
        config = self.models[0].config
        expected = expected_weight_shapes(config)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # a tied model's state dict names the embedding twice
            if name not in expected:
                raise CheckpointError(f"tensor {name!r} is not one of this model's")
            if name in out:
                raise CheckpointError(f"tensor {name!r} is given twice")
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = getattr(tensor, "dtype", type(tensor).__name__)
                raise CheckpointError(f"tensor {name!r} is {kind}, not a floating-point tensor")
            if tuple(tensor.shape) != expected[name]:
                shape = tuple(tensor.shape)
                raise CheckpointError(
                    f"tensor {name!r} has shape {shape}, expected {expected[name]}"
                )
            out[name] = tensor.detach().to("cpu", self.models[0].dtype, copy=True)
        if not out:
            raise CheckpointError("no tensor of this model was given")
        check_finite(out)
        return out

    def _with(self, pushed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole set: the pushed tensors over the serving ones (read from their folder the
        first time)."""
        expected = expected_weight_shapes(self.models[0].config)
        if len(pushed) == len(expected):
            return pushed
        base = self.host
        if base is None:
            if self.folder is None:
                raise CheckpointError("the model was built from tensors: push every tensor")
            base = self._read(self.folder)
        return {**base, **pushed}

    def _serve(self, weights: dict[str, torch.Tensor]) -> str:
        """Stage every part beside the serving weights, then commit them all."""
        digest = weights_digest(weights, self.models[0].linear_kind)  # before: cannot fail after
        staged = [model.stage(weights) for model in self.models]
        self.streams.synchronize()
        with self.streams.computing():
            for model, part in zip(self.models, staged, strict=True):
                model.commit(part)
        self.streams.synchronize()
        return digest


def _unreadable(source: WeightSource) -> str:
    if isinstance(source, DiskWeights):
        return "could not load the checkpoint: it could not be read as a model checkpoint"
    return f"{_refused(source)}: they could not be taken as this model's weights"


def _refused(source: WeightSource) -> str:
    if isinstance(source, DiskWeights):
        return "could not load the checkpoint"
    return f"refused the new weights ({source.origin})"
