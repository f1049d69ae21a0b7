"""The weight-update routes' rows of the route table (route_table.py; api/http/weight_routes.py
serves them). Admin routes: each changes what the engine serves."""

from __future__ import annotations

from shoal.api.http.errors import ErrorEnvelope
from shoal.api.http.lifecycle import Outcome
from shoal.api.http.routing import Body, Route
from shoal.api.http.weight_routes import (
    DestroyGroupRequest,
    InitGroupRequest,
    MemoryRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    UpdateWeightsRequest,
    WeightRoutes,
)

_ANSWERS = {"200": (Body(Outcome),), "400": (Body(Outcome), Body(ErrorEnvelope))}
_KEPT = " A refusal (400, success false) leaves the old weights serving."

WEIGHT_ROUTES: tuple[Route, ...] = (
    Route(
        method="POST",
        path="/update_weights_from_disk",
        handler=WeightRoutes.from_disk,
        summary="Load a same-architecture checkpoint",
        responses=_ANSWERS,
        request=UpdateWeightsRequest,
        description="A folder of safetensors." + _KEPT,
        tags=("lifecycle",),
    ),
    Route(
        method="POST",
        path="/update_weights_from_tensor",
        handler=WeightRoutes.from_tensor,
        summary="Load tensors sent as a pickle (off unless --allow-pickled-weights)",
        responses={**_ANSWERS, "403": (Body(ErrorEnvelope),)},
        request=UpdateFromTensorRequest,
        description="SGLang's body: base64 of a pickled list of (name, tensor), any subset of "
        "the model's. Unpickling runs code the sender chooses: the route answers 403 unless "
        "the server started with --allow-pickled-weights, and then takes the admin key only."
        + _KEPT,
        tags=("lifecycle",),
    ),
    Route(
        method="POST",
        path="/init_weights_update_group",
        handler=WeightRoutes.init_group,
        summary="Join a trainer's process group (torch.distributed) for weight pushes",
        responses=_ANSWERS,
        request=InitGroupRequest,
        example={
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
        },
        tags=("lifecycle",),
    ),
    Route(
        method="POST",
        path="/update_weights_from_distributed",
        handler=WeightRoutes.from_distributed,
        summary="Receive weights broadcast by the trainer's rank src_rank, then load them",
        responses=_ANSWERS,
        request=UpdateFromDistributedRequest,
        description="Commits only once every tensor arrived and fits; a failed receive also "
        "closes the group." + _KEPT,
        tags=("lifecycle",),
    ),
    Route(
        method="POST",
        path="/destroy_weights_update_group",
        handler=WeightRoutes.destroy_group,
        summary="Leave a weight update group",
        responses=_ANSWERS,
        request=DestroyGroupRequest,
        body_optional=True,
        tags=("lifecycle",),
    ),
    *(
        Route(
            method=method,
            path=path,
            handler=handler,
            summary=summary,
            responses=_ANSWERS,
            request=MemoryRequest,
            body_optional=True,
            access="admin",
            description="tags: kv_cache, weights (null: both). Starts once no request holds "
            "anything; while memory is released new requests wait.",
            tags=("lifecycle",),
        )
        for path, handler, summary in (
            (
                "/release_memory_occupation",
                WeightRoutes.release_memory,
                "Free the KV cache and/or the weights until resumed",
            ),
            (
                "/resume_memory_occupation",
                WeightRoutes.resume_memory,
                "Take the released memory back (weights rebuilt from their source)",
            ),
        )
        for method in ("POST", "GET")
    ),
)
