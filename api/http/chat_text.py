"""One chat choice's text as OpenAI's message parts: reasoning (`--reasoning-parser`), content,
and tool calls (api/http/chat_tools.py), for the whole answer and for its stream.

    text = ChoiceText(plan, reasoning)       # per choice; plan/reasoning None: content only
    delta = text.feed(delta_text)            # a ChatDelta to send now, or None
    delta, finish = text.end(finish_reason)  # what was held back, and the finish to report
    message, finish = whole_message(text, finish_reason, plan, reasoning)

While streaming, content that may be a tool call is held back (from the parser's start tag
on; all of it for "required" and a named choice) and read as calls at the end; everything
else streams as it comes. An answer that carries calls finishes "tool_calls" (if the model
ended it: one cut by max_tokens keeps "length" and its text as content).
"""

from __future__ import annotations

from shoal.api.http.chat_tools import ToolPlan, call_id
from shoal.api.http.openai_protocol import (
    AssistantMessage,
    ChatDelta,
    ChatFinishReason,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
)
from shoal.api.http.reasoning import ReasoningParser, ReasoningSplit, held_back, split_whole
from shoal.api.http.tool_parsers import Call
from shoal.results import FinishReason


def _finish(calls: list[Call], finish: FinishReason) -> ChatFinishReason:
    return "tool_calls" if calls and finish == "stop" else finish


def whole_message(
    text: str, finish: FinishReason, plan: ToolPlan | None, reasoning: ReasoningParser | None
) -> tuple[AssistantMessage, ChatFinishReason]:
    thought, content = (None, text) if reasoning is None else split_whole(reasoning, text)
    calls: list[Call] = []
    answer: str | None = content
    if plan is not None and plan.calls_expected and finish == "stop":
        answer, calls = plan.calls_of(content)
    tool_calls = [ToolCall(id=call_id(), function=FunctionCall(n, a)) for n, a in calls]
    message = AssistantMessage("assistant", answer, thought, tool_calls or None)
    return message, _finish(calls, finish)


class ChoiceText:
    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.plan = plan if plan is not None and plan.calls_expected else None
        self.split = None if reasoning is None else ReasoningSplit(reasoning)
        self.held = ""  # content that may be a call
        self.holding = self.plan is not None and self.plan.mode in ("required", "named")
        self.started = False  # content seen (llama3_json decides on its first character)

    def feed(self, text: str) -> ChatDelta | None:
        thought, content = ("", text) if self.split is None else self.split.feed(text)
        return self._delta(thought, self._content(content))

    def end(self, finish: FinishReason) -> tuple[ChatDelta, ChatFinishReason]:
        """One delta with everything held back (the reasoning's and the content's tails, the
        calls), to go with the finish."""
        thought = content = ""
        if self.split is not None:
            thought, tail = self.split.finish()
            content = self._content(tail)
        held, self.held = self.held, ""
        calls: list[Call] = []
        rest: str | None = held
        if self.plan is not None and held and finish == "stop":
            rest, calls = self.plan.calls_of(held)
        content += rest or ""
        items = [
            ToolCallDelta(i, call_id(), "function", FunctionCall(name, arguments))
            for i, (name, arguments) in enumerate(calls)
        ]
        delta = ChatDelta(
            content=content or None, reasoning_content=thought or None, tool_calls=items or None
        )
        return delta, _finish(calls, finish)

    def _content(self, content: str) -> str:
        """What of `content` streams now; the rest is held as a possible call."""
        if self.plan is None or not content:
            return content
        if self.holding:
            self.held += content
            return ""
        parser = self.plan.parser
        assert parser is not None
        if not parser.start:  # llama3_json: a call is the whole answer, opening with "{"
            if not self.started:
                stripped = content.lstrip()
                if not stripped:
                    self.held += content
                    return ""
                self.started = True
                if stripped[0] in "{<":
                    self.holding = True
                    self.held += content
                    return ""
                content, self.held = self.held + content, ""
            return content
        text = self.held + content
        at = text.find(parser.start)
        if at >= 0:
            self.holding = True
            self.held = text[at:]
            return text[:at]
        keep = held_back(text, parser.start)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    @staticmethod
    def _delta(thought: str, content: str) -> ChatDelta | None:
        if not thought and not content:
            return None
        return ChatDelta(content=content or None, reasoning_content=thought or None)
