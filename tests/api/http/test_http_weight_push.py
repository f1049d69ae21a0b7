"""The weight-push routes with SGLang's bodies (api/http/weight_routes.py): tensors as a
base64 pickle (off unless --allow-pickled-weights, then the admin key only), and a trainer's
group joined and received from over HTTP, with the fields verl, slime and AReaL send."""

from __future__ import annotations

import asyncio
import base64
import pickle
from pathlib import Path
from typing import Any

import torch
from engines import EngineFactory
from served import Served, ServeFactory
from weight_pushes import Trainer, checkpoint, specs

from shoal.models.load import load_model

ADMIN = {"Authorization": "Bearer admin-key"}
IDS = [5, 9, 14, 3, 77, 20]


async def call(s: Served, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    async with s.http.post(s.url + path, json=body, headers=headers or ADMIN) as resp:
        return resp.status, await resp.json()


async def greedy(s: Served) -> list[int]:
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, got = await call(s, "/generate", {"input_ids": IDS, "sampling_params": sampling})
    assert status == 200, got
    return list(got["output_ids"])


def payload(named: list[tuple[str, torch.Tensor]]) -> str:
    """verl's: MultiprocessingSerializer's pickle of [(name, tensor)], base64."""
    return base64.b64encode(pickle.dumps(named)).decode()


async def test_the_tensor_route_is_off_unless_asked_and_then_admin_only(
    serve: ServeFactory, other_folder: Path
) -> None:
    body = {"serialized_named_tensors": [payload([])], "load_format": None, "flush_cache": True}
    s = await serve(admin_api_key="admin-key")
    status, got = await call(s, "/update_weights_from_tensor", body)
    assert status == 403 and "--allow-pickled-weights" in got["error"]["message"], got
    s = await serve(admin_api_key="admin-key", allow_pickled_weights=True)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with s.http.post(
            s.url + "/update_weights_from_tensor", json=body, headers=headers
        ) as resp:
            assert resp.status == 401, await resp.text()


async def started_on(make_engine: EngineFactory, folder: Path) -> list[int]:
    """The greedy tokens of an engine started on `folder`."""
    engine = await make_engine(load_model(folder, progress=False))
    done = await engine.generate(
        input_ids=IDS, max_new_tokens=8, temperature=0.0, ignore_eos=True
    ).result()
    return list(done.token_ids)


async def test_tensors_pushed_as_verl_sends_them_serve_the_other_checkpoint(
    serve: ServeFactory, make_engine: EngineFactory, other_folder: Path
) -> None:
    s = await serve(admin_api_key="admin-key", allow_pickled_weights=True)
    before = await greedy(s)
    named = sorted(checkpoint(other_folder).items())
    half = len(named) // 2
    for bucket in (named[:half], named[half:]):  # verl: one request a bucket
        body = {
            "serialized_named_tensors": [payload(bucket)],
            "load_format": None,
            "flush_cache": True,
        }
        status, got = await call(s, "/update_weights_from_tensor", body)
        assert status == 200 and got["success"] is True, got
    after = await greedy(s)
    assert after == await started_on(make_engine, other_folder) != before
    # refusals: the old weights serve on
    name, tensor = named[0]
    for bad, param in (
        ({"serialized_named_tensors": [payload([(name, tensor[:1])])]}, "serialized_named_tensors"),
        ({"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors"),
        (
            {"serialized_named_tensors": [base64.b64encode(b"junk").decode()]},
            "serialized_named_tensors",
        ),
        (
            {"serialized_named_tensors": [base64.b64encode(pickle.dumps({"a": 1})).decode()]},
            "serialized_named_tensors",
        ),
        ({"serialized_named_tensors": [payload(named)] * 2}, "serialized_named_tensors"),
        (
            {"serialized_named_tensors": [payload(named)], "load_format": "flattened_bucket"},
            "load_format",
        ),
    ):
        status, got = await call(s, "/update_weights_from_tensor", bad)
        assert status == 400 and got["error"]["param"] == param, got
    assert await greedy(s) == after


async def test_a_trainer_group_over_http_as_areal_and_slime_call_it(
    serve: ServeFactory, make_engine: EngineFactory, other_folder: Path
) -> None:
    s = await serve(admin_api_key="admin-key")
    before = await greedy(s)
    trainer = Trainer(other_folder, "push")
    try:
        init = {  # AReaL's body: master_port a string, pp_rank beside it
            "master_address": "127.0.0.1",
            "master_port": str(trainer.port),
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
            "group_name": "weight_update_group",
            "pp_rank": 0,
        }
        status, got = await call(s, "/init_weights_update_group", init)
        assert status == 200 and got["success"] is True, got
        assert await asyncio.to_thread(trainer.line) == "joined"
        names, dtypes, shapes = specs(other_folder)
        body = {  # slime's body
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": "weight_update_group",
            "flush_cache": False,
            "weight_version": "3",
        }
        status, got = await call(s, "/update_weights_from_distributed", body)
        assert status == 200 and got["success"] is True and got["weight_version"] == "3", got
        assert await greedy(s) == await started_on(make_engine, other_folder) != before
        status, got = await call(
            s, "/destroy_weights_update_group", {"group_name": "weight_update_group"}
        )
        assert status == 200 and got["success"] is True, got
        status, got = await call(s, "/update_weights_from_distributed", body)
        assert (
            status == 400 and got["success"] is False and "no weight update group" in got["message"]
        )
        status, got = await call(s, "/init_weights_update_group", {**init, "master_port": "http"})
        assert status == 400 and got["error"]["param"] == "master_port", got
    finally:
        trainer.stop()
