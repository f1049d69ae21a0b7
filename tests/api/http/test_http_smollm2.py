"""The server on the bundled SmolLM2-135M-Instruct, driven by the openai client."""

from __future__ import annotations

import openai
import pytest

from shoal.api.engine import Engine
from shoal.api.http.server import Server, ServerOptions

pytestmark = pytest.mark.slow


async def test_openai_client_chats_with_the_bundled_model() -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    # float32: the answer's first token wins by 0.08 nats ("The" over "L"), which bfloat16's
    # rounding (dtype auto on a CPU with AVX512-BF16 or AMX) may flip, and then no "Paris"
    async with (
        Engine(strict_integrity=True, seed=0, dtype="float32") as engine,
        Server(engine, ServerOptions(port=0, served_model_name="SmolLM2-135M-Instruct")) as server,
    ):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        reply = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            max_tokens=24,
            temperature=0,  # type: ignore[arg-type]
        )
        direct = await engine.generate(
            messages=messages, max_new_tokens=24, temperature=0.0
        ).result()
        assert reply.choices[0].message.content == direct.text
        assert "Paris" in direct.text
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == direct.text
        await client.close()
        await engine.check_integrity()
