"""The tokenizer actor tests' own fixture: the bundled SmolLM2's tokenizer alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.loading.loader import load_tokenizer, model_folder


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Iterator[HFTokenizer]:
    """SmolLM2-135M-Instruct's tokenizer (its weights are not read)."""
    with model_folder(None, progress=False) as folder:
        yield load_tokenizer(folder)
