"""A reasoning model's thinking apart from its answer (`--reasoning-parser`): the text inside
`<think>...</think>` goes to `reasoning_content`, the rest to `content`, in whole answers and
stream deltas alike.

    qwen3         the answer may open with <think> (Qwen3; with `chat_template_kwargs`
                  {"enable_thinking": false} it does not, and all of it is content)
    deepseek_r1   the template opened the block: everything before </think> is reasoning
                  (DeepSeek-R1 and its distillations), a <think> the model repeats dropped

    split = ReasoningSplit(PARSERS["qwen3"])
    reasoning, content = split.feed(delta_text)     # as the deltas come
    reasoning, content = split.finish()             # what was held back at the end

A tag cut between two deltas is held back until it is whole, so neither side ever shows part
of one; a block never closed (the answer ran out of tokens) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened: bool  # the prompt opened the block (deepseek_r1): the answer starts inside it


PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", opened=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opened=True),
}


def held_back(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag`."""
    for keep in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


class ReasoningSplit:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "opening"  # opening | thinking | after | answer
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "opening":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state = stripped[len(START) :], "thinking"
                elif START.startswith(stripped):  # nothing yet, or part of the tag
                    return reasoning, content
                else:
                    self.state = "thinking" if self.parser.opened else "answer"
                continue
            if self.state == "thinking":
                at = self.held.find(END)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(END) :], "after"
                    continue
                keep = held_back(self.held, END)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                return reasoning, content
            if self.state == "after":  # the answer starts at its first visible character
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, content
                self.state = "answer"
            content += self.held
            self.held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: the reasoning's tail in an unclosed block, else content."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        if self.state == "opening" and not self.parser.opened:
            return "", held
        return ("", held) if self.state != "opening" else (held, "")


def split_whole(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning None where there was no block."""
    split = ReasoningSplit(parser)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    thought = split.state in ("thinking", "after", "answer") and (
        parser.opened or text.lstrip().startswith(START)
    )
    return (r1 + r2 if thought else None), c1 + c2
