"""`--reasoning-parser qwen3`: split Qwen3 / Qwen3.5 output into reasoning and content.

The Qwen3.5 chat template opens `<think>\\n` in the generation prompt, so with thinking on the output
starts inside the reasoning and `</think>` ends it; with `enable_thinking: false` the template closes an
empty block and the output is content from the start. As in SGLang's Qwen3 detector:
- text before `</think>` is reasoning, the rest content; an output cut off before `</think>` is all
  reasoning;
- a `<think>` the model writes itself at the very start opens reasoning (and is dropped);
- a `<tool_call>` inside the reasoning is not reasoning: the block up to `</tool_call>` goes to the
  content side, where the tool-call parser reports it (Qwen3.5 sometimes calls a tool without closing
  `</think>`). Unlike SGLang, reasoning resumes after the block, so a later `</think>` still splits.

Markers are matched on text, so `</think>` may arrive as its own token (id 248069) or spelled over
several tokens; a tail that may still become a marker is held back until the next chunk or `finish`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_tpu_qwen.parsers.markers import (
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    find_first,
    partial_marker_len,
)

_REASONING, _CONTENT, _TOOL_IN_REASONING = "reasoning", "content", "tool_in_reasoning"


@dataclass
class ReasoningDelta:
    """Text newly assigned to each side by one `feed` or `finish` call."""

    reasoning: str = ""
    content: str = ""


class Qwen3ReasoningParser:
    """Incremental reasoning/content splitter for one output (see module docstring).

    Args:
        thinking: the output starts inside the reasoning (the template opened `<think>`); False when the
            request set `enable_thinking: false`.
        tool_calls_leave_reasoning: route `<tool_call>` blocks inside the reasoning to the content side.

    `feed` chunks in order and `finish` once; the concatenated deltas do not depend on how the text was
    chunked, so a streamed reply agrees with a non-streamed one (`parse`).
    """

    name = "qwen3"

    def __init__(self, thinking: bool = True, tool_calls_leave_reasoning: bool = True) -> None:
        self._mode = _REASONING if thinking else _CONTENT
        self._tool_markers = tool_calls_leave_reasoning
        self._at_start = True  # nothing consumed yet: a leading <think> opens reasoning
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        """Add the next piece of output text; return what can be assigned to a side now."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        """End of output: assign the held-back tail (a partial marker is plain text after all)."""
        return self._drain(final=True)

    @classmethod
    def parse(cls, text: str, thinking: bool = True) -> ReasoningDelta:
        """Split a complete output in one call."""
        parser = cls(thinking=thinking)
        first, last = parser.feed(text), parser.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)

    @property
    def in_reasoning(self) -> bool:
        """True while the text being read is reasoning."""
        return self._mode == _REASONING

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while self._buf:
            if self._at_start:
                if self._buf.startswith(THINK_START):
                    self._buf = self._buf[len(THINK_START):]
                    self._mode = _REASONING
                    self._at_start = False
                    continue
                if THINK_START.startswith(self._buf) and not final:
                    break  # may still become <think>
                self._at_start = False
            if self._mode == _CONTENT:
                out.content += self._buf
                self._buf = ""
            elif self._mode == _REASONING:
                markers = (THINK_END, TOOL_CALL_START) if self._tool_markers else (THINK_END,)
                hit = find_first(self._buf, markers)
                if hit is None:
                    out.reasoning += self._take_safe(markers, final)
                    break
                index, marker = hit
                out.reasoning += self._buf[:index]
                self._buf = self._buf[index + len(marker):]
                if marker == THINK_END:
                    self._mode = _CONTENT
                else:
                    out.content += marker
                    self._mode = _TOOL_IN_REASONING
            else:  # inside a tool-call block that opened in the reasoning
                index = self._buf.find(TOOL_CALL_END)
                if index < 0:
                    out.content += self._take_safe((TOOL_CALL_END,), final)
                    break
                end = index + len(TOOL_CALL_END)
                out.content += self._buf[:end]
                self._buf = self._buf[end:]
                self._mode = _REASONING
        return out

    def _take_safe(self, markers: tuple[str, ...], final: bool) -> str:
        """Remove and return the buffer except a tail that may still grow into one of `markers`."""
        keep = 0 if final else partial_marker_len(self._buf, markers)
        cut = len(self._buf) - keep
        taken, self._buf = self._buf[:cut], self._buf[cut:]
        return taken

