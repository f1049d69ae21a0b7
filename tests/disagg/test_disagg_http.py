"""SGLang's disaggregation fields at the HTTP doors (api/http/bootstrap_fields.py): checked
on a prefill or decode server (a 400 naming the field), ignored on a plain one."""

from __future__ import annotations

from typing import Any

import pytest
from served import ServeFactory

IDS = [5, 17, 42, 99, 7, 3]


def body(**fields: Any) -> dict[str, Any]:
    return {"input_ids": IDS, "sampling_params": {"max_new_tokens": 2}, **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"bootstrap_room": -1, "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
        ({"bootstrap_room": 2**63, "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
        ({"bootstrap_room": 5}, "bootstrap_host"),
        ({"bootstrap_room": 5, "bootstrap_host": "h", "bootstrap_port": 70000}, "bootstrap_port"),
        ({"bootstrap_room": [5, 6], "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
    ],
)
async def test_bad_disaggregation_fields_are_a_400_naming_the_field(
    serve: ServeFactory, fields: dict[str, Any], param: str
) -> None:
    s = await serve(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="local",
        disaggregation_timeout_s=1.0,
    )
    async with s.http.post(s.url + "/generate", json=body(**fields)) as response:
        assert response.status == 400
        assert (await response.json())["error"]["param"] == param


async def test_a_batch_needs_a_room_per_prompt(serve: ServeFactory) -> None:
    s = await serve(disaggregation_mode="decode", disaggregation_transfer_backend="local")
    fields = {"input_ids": [IDS, IDS], "bootstrap_room": 5, "bootstrap_host": "127.0.0.1"}
    async with s.http.post(s.url + "/generate", json=body(**fields)) as response:
        assert response.status == 400
        assert "2 bootstrap rooms" in (await response.json())["error"]["message"]


async def test_a_plain_server_ignores_them(serve: ServeFactory) -> None:
    s = await serve()
    fields = {"bootstrap_room": -1, "bootstrap_host": None, "bootstrap_port": 5}
    async with s.http.post(s.url + "/generate", json=body(**fields)) as response:
        assert response.status == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with s.http.post(s.url + "/v1/chat/completions", json={**chat, **fields}) as response:
        assert response.status == 200
