"""The engine tests' own fixture: the bundled SmolLM2-135M-Instruct, loaded once a module."""

from __future__ import annotations

import pytest

from shoal.models.load import LoadedModel, load_model


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, progress=False)
