"""The prompts of bench/speculative.py: chat messages that copy from their input (rewrite a
given code block with one name changed) and ones with nothing to copy (write new prose)."""

from __future__ import annotations

from typing import Any

CODE_BLOCKS = (
    '''def parse_config(path):
    """Read a config file of key = value lines, skipping comments."""
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def merge_configs(base, override):
    """Return a new dict with the override's keys on top of the base's."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
''',
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        left = self.items.get(name, 0) - count
        if left < 0:
            raise ValueError("not enough " + name)
        self.items[name] = left

    def total(self):
        return sum(self.items.values())
""",
    """def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n):
    counts = word_counts(text)
    ranked = sorted(counts.items(), key=lambda pair: pair[1], reverse=True)
    return ranked[:n]
""",
)
RENAMES = (
    ("parse_config", "read_config"),
    ("Inventory", "Stock"),
    ("word_counts", "count_words"),
)
TOPICS = (
    "a dragon who learns to bake bread",
    "a lighthouse keeper who finds a message in a bottle",
    "a robot that wants to become a gardener",
    "two friends lost in a snowstorm",
)


def copy_messages(i: int) -> list[dict[str, Any]]:
    """The i-th copy-heavy prompt: a code block to give back with one name changed."""
    block = i % len(CODE_BLOCKS)
    old, new = RENAMES[block]
    text = (
        f"Rewrite this Python code with {old} renamed to {new}. Output only the code.\n\n"
        f"```python\n{CODE_BLOCKS[block]}```"
    )
    return [{"role": "user", "content": text}]


def prose_messages(i: int) -> list[dict[str, Any]]:
    """The i-th prompt with nothing to copy: a short story on a topic."""
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


WORKLOADS = {"copy": copy_messages, "prose": prose_messages}
