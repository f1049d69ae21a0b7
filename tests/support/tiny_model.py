"""A tiny random Llama (or Qwen2-style) model folder for tests, deterministic and fast to build.

    folder = make_tiny_model_folder(tmp_path / "tiny", tie=False, qwen_bias=True)
    # folder/config.json, generation_config.json, model.safetensors (HF names, float32),
    # tokenizer.json + tokenizer_config.json (byte-level BPE, ChatML chat template)

The folder is written by transformers' own save_pretrained, so transformers loads it as the
oracle (`AutoModelForCausalLM.from_pretrained(folder)`) and shoal's loader reads the same files.

Determinism: every parameter is drawn from a torch.Generator seeded with `seed` (transformers'
own init is overwritten), and the tokenizer is trained on a fixed corpus. The weights are "peaky"
(std 0.2 instead of 0.02), so greedy argmax is far from ties, norms are 1 +- 0.1 noise and
biases nonzero, so swapping any two tensors changes the output.

Token ids: 0 <|endoftext|> (pad), 1 <|im_start|> (bos), 2 <|im_end|> (eos). The tokenizer's
vocabulary is exactly the model's vocab_size, so every id the model can emit decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A shoal of fish moves as one body through the water.",
    "Hello, how are you today? I am fine, thank you very much.",
    "Paged attention stores the key and value cache in fixed-size pages.",
    "The scheduler forms batches under a token budget and launches them in order.",
    "Every request keeps its slot from admission until it is released.",
    "Prefix caching lets two requests share the pages of a common prompt.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 12, 345 and 6789 appear in text, as do dates such as 2024-06-01.",
    "Café, naïve, déjà vu, Straße, smörgåsbord: accents are bytes too.",
    "Emoji such as 🙂 and 🐟 take four bytes in UTF-8.",
    "def forward(self, x):\n    return self.linear(x) + x\n",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a little model that wanted to generate text.",
    "It read many books, learned many words, and then it answered questions.",
    "Greedy decoding always picks the token with the highest probability.",
    "Sampling draws the next token at random from the softened distribution.",
    "The server streams tokens to the client as soon as they are ready.",
    "Sessions keep their cache across turns so only new text is prefilled.",
    "Weights can be updated from disk while the engine stays up.",
    "Rotary position embeddings rotate pairs of query and key features.",
    "Grouped query attention shares each key head among several query heads.",
    "Mountains, rivers, forests and deserts cover the surface of the earth.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "Peter Piper picked a peck of pickled peppers.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "Red, orange, yellow, green, blue, indigo and violet are the colors of the rainbow.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    "January, February, March, April, May, June, July, August, September.",
    "The answer to the question is forty-two, said the computer after a long time.",
]


def make_tiny_tokenizer(
    vocab_size: int = 512, corpus: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens and a ChatML template,
    trained on `corpus` (default: the fixed sentences above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4 if corpus is None else corpus, trainer)
    assert backend.get_vocab_size() == vocab_size, (backend.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def make_tiny_model_folder(
    path: Path,
    *,
    tie: bool = True,
    qwen_bias: bool = False,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    init_std: float = 0.2,
    seed: int = 0,
    corpus: list[str] | None = None,
) -> Path:
    """Write a tiny random Llama (Qwen2 with q/k/v biases if `qwen_bias`) into `path`; its
    tokenizer trained on `corpus` (make_tiny_tokenizer's)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if qwen_bias:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))

    return save_seeded(model, path, vocab_size, seed=seed, init_std=init_std, corpus=corpus)


def save_seeded(
    model: Any,
    path: Path,
    vocab_size: int,
    *,
    seed: int,
    init_std: float = 0.2,
    norm_mean: float = 1.0,
    corpus: list[str] | None = None,
) -> Path:
    """Draw every parameter of a transformers model from a generator seeded with `seed` (norms
    `norm_mean` +- 0.1, the rest std `init_std`), then save it and the tiny tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(norm_mean + 0.1 * noise)
            else:
                param.copy_(init_std * noise)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    make_tiny_tokenizer(vocab_size, corpus).save_pretrained(path, save_jinja_files=False)
    return path
