"""One chat choice's output through the configured parsers: reasoning first, then tool calls.

The reasoning parser splits the text into reasoning and content; the content side (including tool-call
blocks the reasoning parser moved out of the reasoning) goes through the tool-call parser. Streaming and
non-streaming replies both run this, the non-streamed one in a single `feed`, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_tpu_qwen.parsers.qwen3_coder import Qwen3CoderParser
from sglang_tpu_qwen.parsers.reasoning import Qwen3ReasoningParser, ReasoningDelta
from sglang_tpu_qwen.parsers.tool_calls import ParsedToolCall, ToolCallDelta, ToolParseDelta, merge_call_deltas

# SGLang's parser names (`--reasoning-parser`, `--tool-call-parser`) of the parsers this runtime has.
REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
TOOL_CALL_PARSERS: dict[str, type[Qwen3CoderParser]] = {"qwen3_coder": Qwen3CoderParser}


@dataclass
class ChatDelta:
    """What one `feed`/`finish` adds to the reply message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedChatMessage:
    """A whole reply message: reasoning (None when empty), content, tool calls (in output order)."""

    reasoning: str | None
    content: str
    tool_calls: list[ParsedToolCall]


class ChatOutputParser:
    """Parsers for one choice.

    Args:
        reasoning_parser: a REASONING_PARSERS name, or None (no reasoning split).
        tool_call_parser: a TOOL_CALL_PARSERS name, or None. Tool calls are parsed only when `tools` is
            non-empty (the request offered tools and tool_choice is not "none"), as in SGLang.
        thinking: the generation prompt opened a reasoning block (chat_template_kwargs enable_thinking).
        tools: the request's OpenAI tools.

    Raises:
        ValueError: an unknown parser name.
    """

    def __init__(self, reasoning_parser: str | None = None, tool_call_parser: str | None = None, *,
                 thinking: bool = True, tools: Sequence[Any] | None = None) -> None:
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {sorted(REASONING_PARSERS)}")
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {sorted(TOOL_CALL_PARSERS)}")
        self._reasoning = REASONING_PARSERS[reasoning_parser](thinking=thinking) if reasoning_parser else None
        self._tools = TOOL_CALL_PARSERS[tool_call_parser](tools) if tool_call_parser and tools else None

    @property
    def active(self) -> bool:
        """False when the text passes through unchanged (no parser applies to this request)."""
        return self._reasoning is not None or self._tools is not None

    def feed(self, text: str) -> ChatDelta:
        """The next piece of output text (detokenized, stop strings already cut)."""
        split = self._reasoning.feed(text) if self._reasoning else ReasoningDelta(content=text)
        return self._combine(split, self._tools.feed(split.content) if self._tools else None)

    def finish(self) -> ChatDelta:
        """End of output: everything still held back."""
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        if self._tools is None:
            return self._combine(split, None)
        fed, last = self._tools.feed(split.content), self._tools.finish()
        return self._combine(split, ToolParseDelta(fed.content + last.content, fed.calls + last.calls))

    def parse(self, text: str) -> ParsedChatMessage:
        """A complete output (on a fresh parser)."""
        return accumulate([self.feed(text), self.finish()])

    @staticmethod
    def _combine(split: ReasoningDelta, tools: ToolParseDelta | None) -> ChatDelta:
        if tools is None:
            return ChatDelta(reasoning=split.reasoning, content=split.content)
        return ChatDelta(reasoning=split.reasoning, content=tools.content, tool_calls=tools.calls)


def accumulate(deltas: Iterable[ChatDelta]) -> ParsedChatMessage:
    """The message that a sequence of deltas adds up to."""
    deltas = list(deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    merged = merge_call_deltas(c for d in deltas for c in d.tool_calls)
    return ParsedChatMessage(
        reasoning=reasoning or None,
        content="".join(d.content for d in deltas),
        tool_calls=[ParsedToolCall(index=c.index, name=c.name or "", arguments=c.arguments) for c in merged],
    )
