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

from shoal.config import DEFAULT_SESSION_TIMEOUT_S
from shoal.params import SamplingParams
from shoal.results import RequestError, RequestStream

if TYPE_CHECKING:
    from shoal.api.engine import Engine


def session_bounds(timeout_s: float | None, max_tokens: int | None, bound_s: float) -> float:
    """A session's idle timeout as opened (not given: 600 s, or `bound_s` if lower), checked
    against `bound_s` (max_session_timeout_s), and its max_tokens checked: RequestError naming
    the option."""
    timeout_s = min(DEFAULT_SESSION_TIMEOUT_S, bound_s) if timeout_s is None else timeout_s
    if not 0 < timeout_s <= bound_s:
        raise RequestError(
            f"timeout_s must be in (0, {bound_s:g}] (max_session_timeout_s), got {timeout_s:g}",
            "timeout_s",
        )
    if max_tokens is not None and max_tokens < 2:
        raise RequestError(f"max_tokens must be >= 2, got {max_tokens}", "max_tokens")
    return timeout_s


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
