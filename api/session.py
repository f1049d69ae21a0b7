"""A streaming session on the Engine: its KV stays across turns, each turn prefills only
what is new (docs/architecture.md, "Sessions").

    async with await engine.open_session(timeout_s=300) as session:
        first = await session.turn(messages=[{"role": "user", "content": "Hi"}]).result()
        async for delta in session.turn(messages=[{"role": "user", "content": "More"}]):
            ...
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from shoal.params import SamplingParams
from shoal.results import RequestStream

if TYPE_CHECKING:
    from shoal.api.engine import Engine


class Session:
    def __init__(self, engine: Engine, session_id: str) -> None:
        self.engine = engine
        self.id = session_id

    def turn(
        self,
        text: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        **sampling_fields: Any,
    ) -> RequestStream:
        """Append one of text / input_ids / messages to the history and stream the reply.
        One turn at a time: a turn sent while another streams fails with ValueError."""
        return self.engine.generate(
            text,
            input_ids=input_ids,
            messages=messages,
            sampling=sampling,
            rid=rid,
            session_id=self.id,
            **sampling_fields,
        )

    async def close(self) -> None:
        """Release everything the session holds (after its live turn, if any, ends)."""
        await self.engine.close_session(self.id)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.engine.dead_reason is None:
            await self.close()
