"""POST /generate's return_routed_experts on a mixture-of-experts model, as slime reads it:
meta_info.routed_experts is base64 of little-endian int32 [(len(tokens) - 1 - start),
num_hidden_layers, num_experts_per_tok] (tokens: prompt and output), the engine's own rows,
with routed_experts_start_len echoed when not 0; streamed, in the last event only. The
OpenAI doors refuse the field; a start past the prompt is a 400 naming it."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from served import MODEL, Served, ServeFactory, post, post_ok, sse_events
from tiny_families import make_family_folder

from shoal.models.load import LoadedModel, load_model

PROMPT = [5, 17, 33, 8, 91, 12, 40, 7, 66]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder: Path = make_family_folder(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    return load_model(folder, progress=False)


def body(**fields: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": PROMPT, "sampling_params": sampling, **fields}


def slime_rows(answer: dict[str, Any], model: LoadedModel) -> np.ndarray:
    """slime's reading: the start with a default of 0, the count checked, then the rows."""
    meta = answer["meta_info"]
    moe = model.config.moe
    assert moe is not None
    start = meta.get("routed_experts_start_len", 0)
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    tokens = PROMPT + answer["output_ids"]
    layers, top_k = model.config.num_layers, moe.top_k
    assert flat.size == (len(tokens) - 1 - start) * layers * top_k
    return flat.reshape(-1, layers, top_k)


async def test_generate_answers_slimes_routed_experts(
    serve: ServeFactory, moe_model: LoadedModel
) -> None:
    s: Served = await serve(model=moe_model)
    plain = await post_ok(s, "/generate", body())
    assert "routed_experts" not in plain["meta_info"]
    whole = await post_ok(s, "/generate", body(return_routed_experts=True))
    assert whole["output_ids"] == plain["output_ids"]
    assert "routed_experts_start_len" not in whole["meta_info"]  # 0: slime's default
    rows = slime_rows(whole, moe_model)
    done = await s.engine.generate(
        input_ids=PROMPT,
        max_new_tokens=5,
        temperature=0.0,
        ignore_eos=True,
        return_routed_experts=True,
    ).result()
    assert done.routed_experts is not None
    assert rows.tobytes() == done.routed_experts
    late = await post_ok(
        s, "/generate", body(return_routed_experts=True, routed_experts_start_len=4)
    )
    assert late["meta_info"]["routed_experts_start_len"] == 4
    np.testing.assert_array_equal(slime_rows(late, moe_model), rows[4:])
    # streamed: the last event alone carries them
    streamed = body(return_routed_experts=True, routed_experts_start_len=4, stream=True)
    async with s.http.post(s.url + "/generate", json=streamed) as resp:
        assert resp.status == 200
        events = [e for e in await sse_events(resp) if e != "[DONE]"]
    assert all("routed_experts" not in e["meta_info"] for e in events[:-1])
    assert events[-1]["meta_info"]["routed_experts"] == late["meta_info"]["routed_experts"]
    assert events[-1]["meta_info"]["routed_experts_start_len"] == 4


async def test_the_callers_mistakes_are_400s(serve: ServeFactory, moe_model: LoadedModel) -> None:
    s: Served = await serve(model=moe_model)
    too_late = body(return_routed_experts=True, routed_experts_start_len=len(PROMPT) + 1)
    status, answer = await post(s, "/generate", too_late)
    assert status == 400 and answer["error"]["param"] == "routed_experts_start_len", answer
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = await post(s, "/v1/chat/completions", {**chat, "return_routed_experts": True})
    assert status == 400 and answer["error"]["param"] == "return_routed_experts", answer


async def test_a_dense_model_answers_400(serve: ServeFactory) -> None:
    s: Served = await serve()
    status, answer = await post(s, "/generate", body(return_routed_experts=True))
    assert status == 400 and answer["error"]["param"] == "return_routed_experts", answer
    assert "no mixture-of-experts layers" in answer["error"]["message"]
