"""The CPU's mixed-prefill cap, unset, is picked at start from the model's measured prompt
token (models/prompt_cost.py, resolve_options.measured_mixed_prefill) and is what the actors
get; a cap given is taken as it is, and nothing is measured."""

from __future__ import annotations

from typing import Any

import pytest
from engines import EngineFactory

from shoal.api import startup
from shoal.resolve_options import Resolved, measured_mixed_prefill


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> list[Resolved]:
    """What each start hands the actors (api/startup.py: start_actors)."""
    seen: list[Resolved] = []
    real = startup.start_actors

    def recording(loaded: Any, options: Any, resolved: Resolved, *rest: Any) -> Any:
        seen.append(resolved)
        return real(loaded, options, resolved, *rest)

    monkeypatch.setattr(startup, "start_actors", recording)
    return seen


async def test_the_start_measures_the_cap_when_unset(
    make_engine: EngineFactory, wired: list[Resolved]
) -> None:
    engine = await make_engine()
    resolved = engine.resolved
    assert resolved is not None and resolved.prompt_token_ms is not None
    assert resolved.prompt_token_ms > 0
    assert resolved.mixed_prefill_tokens == measured_mixed_prefill(resolved.prompt_token_ms)
    # the tiny model's matmuls take microseconds a token: the most the cap may be
    assert resolved.mixed_prefill_tokens == 256 and not resolved.cap_to_measure
    assert wired == [resolved]
    kernels, scheduling = resolved.start_report(engine.attention).splitlines()
    assert kernels.startswith("shoal kernels: ") and "linear=packed" in kernels
    assert scheduling.startswith("shoal scheduling: mixed_prefill_cap=256 (a prompt token's")


@pytest.mark.parametrize("given", [0, 64])
async def test_a_cap_given_is_kept_and_nothing_is_measured(
    make_engine: EngineFactory, wired: list[Resolved], given: int
) -> None:
    engine = await make_engine(max_mixed_prefill_tokens=given)
    resolved = engine.resolved
    assert resolved is not None and resolved.prompt_token_ms is None
    assert resolved.mixed_prefill_tokens == given and wired == [resolved]
    assert resolved.scheduling_report() == f"mixed_prefill_cap={given or 'none'}"
