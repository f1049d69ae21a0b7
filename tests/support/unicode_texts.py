"""Texts whose tokens split characters: accents, CJK, emoji with modifiers and joiners, and
chat specials (the detokenizer tests' inputs)."""

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? Naïve café, smörgåsbord, Ærøskøbing.",
    "日本語のテキストです。中文文本测试。한국어 텍스트도 있어요.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 🚀🚀 and a family 👨‍👩‍👧 at the end.",
    "<|im_start|>assistant\nYes.<|im_end|>\n<|endoftext|>",
]
