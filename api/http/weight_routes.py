"""The weight-update routes, with SGLang's bodies and answers (api/weight_calls.py does the
work; README, "RL rollouts"):

    POST /update_weights_from_disk         {"model_path", "abort_all_requests"?,
                                           "weight_version"?, "load_format"?, "flush_cache"?}
    POST /update_weights_from_tensor       {"serialized_named_tensors": [base64 pickle],
                                           "load_format"?, "flush_cache"?, "weight_version"?,
                                           "abort_all_requests"?}  (off unless
                                           --allow-pickled-weights: see below)
    POST /init_weights_update_group        {"master_address", "master_port", "rank_offset",
                                           "world_size", "group_name"?, "backend"?,
                                           "timeout_s"? (shoal's)}
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name"?,
                                           "flush_cache"?, "weight_version"?,
                                           "abort_all_requests"?, "load_format"?, "src_rank"?}
    POST /destroy_weights_update_group     {"group_name"?}
    POST /release_memory_occupation        {"tags"?: ["kv_cache", "weights"]} (null: both;
    POST /resume_memory_occupation         GET too, as SGLang serves them: the body optional)

Each answers 200 {"success": true, "message", ...} or 400 with success false and why (the
old weights still serve). A weight version is a string (a number is taken as its digits).

/update_weights_from_tensor's payload is a Python pickle (SGLang's MultiprocessingSerializer:
torch's ForkingPickler, so tensors may travel as shared memory or CUDA IPC handles). Unpickling
bytes runs whatever code they name, so whoever may call this route may run code in the server:
it is off (403) unless the server starts with --allow-pickled-weights, which in turn requires
an --admin-api-key, the only key this route then takes.
"""

from __future__ import annotations

import base64
import binascii
import pickle

import msgspec
import torch
import torch.multiprocessing  # registers the reductions that ForkingPickler bytes name
from aiohttp import web

from shoal.api.engine import Engine
from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ApiError, bad_request
from shoal.api.http.lifecycle import Outcome, refusal
from shoal.api.http.limits import HttpLimits, check_chars
from shoal.api.weight_calls import (
    DEFAULT_GROUP,
    DISK_FORMATS,
    MAX_VERSION_CHARS,
    TENSOR_FORMATS,
)
from shoal.api.weight_groups import GroupResult
from shoal.results import UpdateResult

PICKLES_OFF = (
    "POST /update_weights_from_tensor is off: its body is a pickle, and unpickling runs code "
    "the sender chooses. Start the server with --allow-pickled-weights (which needs "
    "--admin-api-key) to take it"
)


class UpdateFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every update route takes besides its weights (SGLang's names)."""

    abort_all_requests: bool = False
    weight_version: int | str | None = None  # SGLang's type is a string; a number is its digits
    load_format: str | None = None
    flush_cache: bool = True  # false is taken and said: the cache is flushed all the same
    torch_empty_cache: bool = False  # taken: the freed host memory always goes back to the OS
    is_async: bool = False  # true refused: an update answers when it is done
    rid: str | None = None  # SGLang's request id on every body: names nothing here

    def checked(self, formats: tuple[str | None, ...]) -> str | None:
        """The weight version as the engine takes it; a 400 for a field it cannot take."""
        if self.is_async:
            why = "is_async true is not supported: the update answers when it is done"
            raise bad_request(why, param="is_async")
        if self.load_format not in formats:
            named = " or ".join("null" if f is None else f for f in formats)
            why = f"load_format {self.load_format!r} is not supported here: {named}"
            raise bad_request(why, param="load_format")
        if self.weight_version is None:
            return None
        version = str(self.weight_version)
        if not 0 < len(version) <= MAX_VERSION_CHARS:
            why = f"weight_version must be 1 to {MAX_VERSION_CHARS} characters"
            raise bad_request(why, param="weight_version")
        return version


class UpdateWeightsRequest(UpdateFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_path: str


class UpdateFromTensorRequest(UpdateFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    serialized_named_tensors: list[str]


class InitGroupRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    master_address: str
    master_port: int | str  # AReaL sends a string (SGLang's pydantic coerces it)
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # default: gloo on the CPU, nccl on CUDA
    timeout_s: float = 300.0  # shoal's: every wait on the group, the rendezvous too
    pp_rank: int | None = None  # AReaL's, per trainer pipeline stage: its group_name tells
    rid: str | None = None


class UpdateFromDistributedRequest(
    UpdateFields, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    src_rank: int = 0  # the trainer's rank in the group (sglang #19251)


class DestroyGroupRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    group_name: str = DEFAULT_GROUP
    rid: str | None = None


class MemoryRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tags: list[str] | None = None  # "kv_cache", "weights"; null: both
    rid: str | None = None


class WeightRoutes:
    def __init__(
        self, engine: Engine, limits: HttpLimits | None = None, allow_pickles: bool = False
    ) -> None:
        self.engine = engine
        self.limits = limits or HttpLimits()
        self.allow_pickles = allow_pickles

    async def from_disk(self, request: web.Request) -> web.Response:
        body = await decode_body(request, UpdateWeightsRequest)
        check_chars(
            len(body.model_path), self.limits.max_path_chars, "model_path", "max_path_chars"
        )
        if not body.model_path.strip():
            raise bad_request("model_path must not be empty", param="model_path")
        result = await self.engine.update_weights_from_disk(
            body.model_path,
            body.abort_all_requests,
            body.checked(DISK_FORMATS),
            body.load_format,
            body.flush_cache,
        )
        return _updated(result, "model_path")

    async def from_tensor(self, request: web.Request) -> web.Response:
        if not self.allow_pickles:
            raise ApiError(403, PICKLES_OFF, code="route_disabled")
        body = await decode_body(request, UpdateFromTensorRequest)
        if len(body.serialized_named_tensors) != 1:
            got = len(body.serialized_named_tensors)
            raise bad_request(
                f"serialized_named_tensors must hold one payload (this engine is one rank), got "
                f"{got}",
                param="serialized_named_tensors",
            )
        named = _unpickled(body.serialized_named_tensors[0])
        result = await self.engine.update_weights_from_tensor(
            named,
            body.load_format,
            body.flush_cache,
            body.checked(TENSOR_FORMATS),
            body.abort_all_requests,
        )
        return _updated(result, "serialized_named_tensors")

    async def init_group(self, request: web.Request) -> web.Response:
        body = await decode_body(request, InitGroupRequest)
        port = body.master_port
        if isinstance(port, str):
            if not (port.isascii() and port.isdigit() and len(port) <= 5):
                raise bad_request(f"master_port must be a port number, got {port!r}", "master_port")
            port = int(port)
        result = await self.engine.init_weights_update_group(
            body.master_address,
            port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            body.timeout_s,
        )
        return _grouped(result)

    async def from_distributed(self, request: web.Request) -> web.Response:
        body = await decode_body(request, UpdateFromDistributedRequest)
        result = await self.engine.update_weights_from_distributed(
            body.names,
            body.dtypes,
            body.shapes,
            body.group_name,
            body.flush_cache,
            body.checked(TENSOR_FORMATS),
            body.abort_all_requests,
            body.load_format,
            body.src_rank,
        )
        return _updated(result, "names")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await decode_body(request, DestroyGroupRequest, empty=DestroyGroupRequest())
        return _grouped(await self.engine.destroy_weights_update_group(body.group_name))

    async def release_memory(self, request: web.Request) -> web.Response:
        body = await decode_body(request, MemoryRequest, empty=MemoryRequest())
        return _changed(await self.engine.release_memory_occupation(body.tags))

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = await decode_body(request, MemoryRequest, empty=MemoryRequest())
        return _changed(await self.engine.resume_memory_occupation(body.tags))


def _unpickled(payload: str) -> list[tuple[str, torch.Tensor]]:
    """SGLang's payload: base64 of a pickled list of (name, tensor) (a 400 if it is not)."""
    field = "serialized_named_tensors"
    try:
        named = pickle.loads(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        raise bad_request("serialized_named_tensors[0] is not base64", field) from None
    except Exception as exc:  # whatever the pickle named failed: its sender's mistake
        raise bad_request(
            f"serialized_named_tensors[0] could not be unpickled: {exc}", field
        ) from None
    if not isinstance(named, list | tuple) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in named
    ):
        raise bad_request("serialized_named_tensors[0] must be a list of (name, tensor)", field)
    return list(named)


def _updated(result: UpdateResult, param: str) -> web.Response:
    if result.success:
        return json_response(Outcome(True, result.message, result.weight_version))
    return refusal(400, result.message, param, "invalid_checkpoint", result.weight_version)


def _grouped(result: GroupResult) -> web.Response:
    if result.success:
        return json_response(Outcome(True, result.message))
    return refusal(400, result.message, "group_name", "weight_group")


def _changed(result: UpdateResult) -> web.Response:
    if result.success:
        return json_response(Outcome(True, result.message))
    return refusal(400, result.message, "tags", "invalid_value")
