"""The model bench/host_cost.py runs when given none: a tiny random Llama folder (2 layers,
hidden 64, vocabulary 512) with a byte-level BPE tokenizer, as real Llama/SmolLM2/Qwen
tokenizers are, so that detokenizing costs what it costs with theirs.

Its weights never run (host_cost_fake.py replaces the forward), so only their shapes matter;
the folder is what shoal's loader and tokenizer actor need. Deterministic for a seed: the
weights are transformers' init under torch.manual_seed(seed), the tokenizer is trained on a
corpus of words drawn from random.Random(seed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0 (pad), 1 (bos), 2 (eos)
VOCAB_SIZE = 512
LETTERS = "etaoinshrdlucmfwypvbgkjqxz" + "éüñ"  # frequency-skewed, a few two-byte ones


def byte_level_tokenizer(vocab_size: int, seed: int) -> Any:
    """A byte-level BPE tokenizer of exactly vocab_size tokens (the specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(LETTERS))]
    words = ["".join(rng.choices(LETTERS, weights, k=rng.randint(1, 8))) for _ in range(20_000)]
    corpus = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    assert backend.get_vocab_size() == vocab_size, (backend.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0],
        model_max_length=4096,
    )


def tiny_llama_folder(folder: Path, seed: int = 0) -> Path:
    """Write the tiny random Llama and its tokenizer into `folder`; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_level_tokenizer(VOCAB_SIZE, seed).save_pretrained(folder)
    return folder
