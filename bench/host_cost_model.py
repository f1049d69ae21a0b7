"""The model bench/host_cost.py runs when given none: the tests' tiny random Llama
(tests/support/tiny_model.py: 2 layers, hidden 64, vocabulary 512) with its byte-level BPE
tokenizer trained on random words rather than the tests' few sentences, so that detokenizing
costs what it costs with real Llama/SmolLM2/Qwen tokenizers.

Its weights never run (host_cost_fake.py replaces the forward), so only their shapes matter;
the folder is what shoal's loader and tokenizer actor need. Deterministic for a seed.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from tiny_model import make_tiny_model_folder

LETTERS = "etaoinshrdlucmfwypvbgkjqxz" + "éüñ"  # frequency-skewed, a few two-byte ones


def random_words(seed: int) -> list[str]:
    """Lines of 12 words of 1-8 letters drawn from random.Random(seed)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(LETTERS))]
    words = ["".join(rng.choices(LETTERS, weights, k=rng.randint(1, 8))) for _ in range(20_000)]
    return [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


def tiny_llama_folder(folder: Path, seed: int = 0) -> Path:
    """Write the tiny random Llama and its tokenizer into `folder`; returns it."""
    return make_tiny_model_folder(
        folder, max_position_embeddings=4096, seed=seed, corpus=random_words(seed)
    )
