"""The HTTP calls slime, verl's HTTP adapter and AReaL make to SGLang, replayed field for
field against shoal (README, "RL rollouts"), each read back as its client reads SGLang's
answer. The bodies are copied from these files (the versions read are in the comments):

- slime (THUDM/slime @624b824a): `slime/rollout/sglang_rollout.py` (the rollout's /generate,
  95-108 and 150-221), `slime/rollout/on_policy_distillation.py` (the teacher's prompt
  logprobs, 8-29), `slime/backends/sglang_utils/sglang_engine.py` (pause, GET /flush_cache
  retried until 200, update_weights_from_disk with a string weight_version, get_weight_version,
  init_weights_update_group, update_weights_from_distributed, destroy, release / resume
  memory, continue; 245-435), `slime/backends/sglang_utils/server_control.py` (abort_all,
  then /v1/loads?include=core until nothing runs or waits; 32-63).
- verl (volcengine/verl @b178a3cd): `verl/workers/rollout/sglang_rollout/http_server_engine.py`
  (release_memory_occupation with tags 720-730, update_weights_from_tensor 747-777, GET
  /flush_cache 779-810, resume_memory_occupation, /generate with None values dropped 812-847).
- AReaL (inclusionAI/AReaL @4aef98d8): `areal/engine/sglang_remote.py` (/generate 43-89, its
  answer read 91-127, pause/continue 273-279, update_weights_from_disk 129-159, init group
  189-271 with master_port a string and pp_rank), `areal/infra/remote_inf_engine.py` (the
  abort-and-resubmit loop 785-852: a request aborted by the pause comes back with its partial
  output and logprobs, and is sent again at once, prompt + partial output, while the server is
  still paused: SGLang holds it until continue).

One change is the CPU's: slime and AReaL ask for backend "nccl", which needs a GPU; here the
group is gloo (a CPU engine answers "nccl" with success false and why,
tests/engine/test_weight_push.py).
"""

from __future__ import annotations

import asyncio
import base64
import pickle
from pathlib import Path
from typing import Any

from engines import EngineFactory
from served import Served, ServeFactory
from weight_pushes import Trainer, checkpoint, specs

from shoal.models.load import load_model

ADMIN = {"Authorization": "Bearer admin-key"}
PROMPT = [5, 17, 42, 99, 7, 3, 61, 8]


async def call(s: Served, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """As the clients call: JSON bodies (slime sends `{}` for none), JSON answers when the
    answer is JSON (AReaL parses by content type), the admin key shoal's routes ask for."""
    async with s.http.request(method, s.url + path, json=body, headers=ADMIN) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


def slime_sampling(max_new_tokens: int) -> dict[str, Any]:
    """sglang_rollout.py's sampling params with slime's defaults."""
    return {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


def areal_body(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """sglang_remote.py's /generate body for a greedy request (gconfig.greedy)."""
    return {
        "input_ids": list(input_ids),
        "image_data": None,
        "sampling_params": {
            "top_p": 1.0,
            "top_k": int(1e8),
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "stop_token_ids": [],
            "ignore_eos": True,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }


def read_as_slime(answer: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """types.py's reading: tokens and logprobs from output_token_logprobs, the finish type."""
    meta = answer["meta_info"]
    triples = meta["output_token_logprobs"]
    assert all(len(t) == 3 and isinstance(t[1], int) for t in triples), triples
    assert isinstance(meta["weight_version"], str)
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert isinstance(meta.get(key, 0), int)
    return [t[1] for t in triples], [t[0] for t in triples], meta["finish_reason"]["type"]


async def test_slime_rollout_distillation_and_weight_sync(
    serve: ServeFactory, make_engine: EngineFactory, tiny_folder: Path, other_folder: Path
) -> None:
    s = await serve(admin_api_key="admin-key")
    # the rollout's /generate
    body = {"sampling_params": slime_sampling(12), "return_logprob": True, "input_ids": PROMPT}
    status, answer = await call(s, "POST", "/generate", body)
    assert status == 200, answer
    tokens, logprobs, finish = read_as_slime(answer)
    assert finish == "length" and len(tokens) == 12 == len(logprobs)
    assert answer["output_ids"] == tokens and isinstance(answer["text"], str)
    # on-policy distillation: the teacher's prompt logprobs, the first one null
    teacher = {
        "input_ids": PROMPT + tokens,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    status, answer = await call(s, "POST", "/generate", teacher)
    assert status == 200, answer
    given = answer["meta_info"]["input_token_logprobs"]
    assert given[0][0] is None and len(given) == len(PROMPT) + 12
    assert all(isinstance(item[0], float) for item in given[1:])
    # the end of a rollout: abort everything, then poll the loads until nothing runs or waits
    assert (await call(s, "POST", "/abort_request", {"abort_all": True}))[0] == 200
    status, loads = await call(s, "GET", "/v1/loads?include=core")
    assert status == 200
    load = loads["loads"][0]
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0
    # the weight sync: pause, flush (GET, until 200), update, version, continue
    status, _ = await call(s, "POST", "/pause_generation", {})
    assert status == 200
    status, _ = await call(s, "GET", "/flush_cache")
    assert status == 200
    update = {"model_path": str(other_folder), "weight_version": "3"}
    status, answer = await call(s, "POST", "/update_weights_from_disk", update)
    assert status == 200 and answer["success"] is True, answer
    status, answer = await call(s, "GET", "/get_weight_version")
    assert status == 200 and answer["weight_version"] == "3"
    assert (await call(s, "POST", "/continue_generation", {}))[0] == 200
    status, answer = await call(s, "POST", "/generate", body)
    assert answer["meta_info"]["weight_version"] == "3"
    # the distributed path: init (gloo here), one update a bucket with flush_cache false and
    # the version as a string, destroy
    trainer = Trainer(tiny_folder, "push", "slime-pp_0")
    try:
        init = {
            "master_address": "127.0.0.1",
            "master_port": trainer.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "slime-pp_0",
            "backend": "gloo",
        }
        status, answer = await call(s, "POST", "/init_weights_update_group", init)
        assert status == 200 and answer["success"] is True, answer
        assert await asyncio.to_thread(trainer.line) == "joined"
        names, dtypes, shapes = specs(tiny_folder)
        push = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": "slime-pp_0",
            "flush_cache": False,
            "weight_version": "7",
        }
        status, answer = await call(s, "POST", "/update_weights_from_distributed", push)
        assert status == 200 and answer["success"] is True, answer
        status, answer = await call(
            s, "POST", "/destroy_weights_update_group", {"group_name": "slime-pp_0"}
        )
        assert status == 200 and answer["success"] is True
    finally:
        trainer.stop()
    # colocated: release everything, resume weights then the KV cache
    assert (await call(s, "POST", "/release_memory_occupation", {}))[0] == 200
    assert (await call(s, "POST", "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
    assert (await call(s, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200
    greedy = {**body, "sampling_params": {**slime_sampling(8), "temperature": 0.0}}
    status, answer = await call(s, "POST", "/generate", greedy)
    assert status == 200 and answer["meta_info"]["weight_version"] == "7"
    started = await make_engine(load_model(tiny_folder, progress=False))
    direct = await started.generate(
        input_ids=PROMPT, max_new_tokens=8, temperature=0.0, skip_special_tokens=False
    ).result()
    assert answer["output_ids"] == list(direct.token_ids)  # the trainer's weights serve


async def test_verl_colocated_weight_sync(
    serve: ServeFactory, make_engine: EngineFactory, other_folder: Path
) -> None:
    s = await serve(admin_api_key="admin-key", allow_pickled_weights=True)
    # release for training, resume the weights, push them in buckets, resume the KV cache
    tags = {"tags": ["kv_cache", "weights"]}
    status, _ = await call(s, "POST", "/release_memory_occupation", tags)
    assert status == 200
    status, _ = await call(s, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 200
    named = sorted(checkpoint(other_folder).items())
    for bucket in (named[: len(named) // 2], named[len(named) // 2 :]):
        serialized = base64.b64encode(pickle.dumps(bucket)).decode()
        push = {"serialized_named_tensors": [serialized], "load_format": None, "flush_cache": True}
        status, answer = await call(s, "POST", "/update_weights_from_tensor", push)
        assert status == 200 and answer["success"] is True, answer
    status, _ = await call(s, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200
    for _ in range(12):  # verl: GET /flush_cache until 200
        status, _ = await call(s, "GET", "/flush_cache")
        if status == 200:
            break
    assert status == 200
    # http_server_engine.generate's body, None values dropped
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    status, answer = await call(s, "POST", "/generate", {**body, "return_logprob": False})
    assert status == 200, answer
    started = await make_engine(load_model(other_folder, progress=False))
    direct = await started.generate(input_ids=PROMPT, max_new_tokens=8, temperature=0.0).result()
    assert answer["output_ids"] == list(direct.token_ids)


async def test_areal_pause_aborts_and_the_resubmission_waits_and_continues_exactly(
    serve: ServeFactory, tiny_folder: Path
) -> None:
    s = await serve(admin_api_key="admin-key")
    total = 300
    status, whole = await call(s, "POST", "/generate", areal_body(PROMPT, total))
    assert status == 200 and len(whole["output_ids"]) == total
    running = asyncio.create_task(call(s, "POST", "/generate", areal_body(PROMPT, total)))
    for _ in range(2000):  # until it has generated a few tokens
        snap = await s.engine.snapshot()
        if any(snap.progress.get(rid, 0) > len(PROMPT) + 3 for rid in snap.running):
            break
        await asyncio.sleep(0.005)
    status, _ = await call(s, "POST", "/pause_generation", {})  # SGLang's default: abort
    assert status == 200
    status, first = await running
    assert status == 200
    meta = first["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
    assert isinstance(meta["finish_reason"].get("message", ""), str)
    partial = [t[1] for t in meta["output_token_logprobs"]]  # AReaL requires the key
    assert 0 < len(partial) < total and partial == first["output_ids"]
    # AReaL resubmits at once, prompt + partial output, while still paused: it must wait
    resubmit = asyncio.create_task(
        call(s, "POST", "/generate", areal_body(PROMPT + partial, total - len(partial)))
    )
    update = {"model_path": str(tiny_folder), "abort_all_requests": True}
    status, answer = await call(s, "POST", "/update_weights_from_disk", update)
    assert status == 200 and answer["success"] is True, answer
    await asyncio.sleep(0.1)
    assert not resubmit.done()
    assert (await call(s, "POST", "/continue_generation", {}))[0] == 200
    status, rest = await asyncio.wait_for(resubmit, 60)
    assert status == 200 and rest["meta_info"]["finish_reason"]["type"] == "length"
    assert partial + rest["output_ids"] == whole["output_ids"]  # same weights: exactly on
