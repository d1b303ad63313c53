"""`--tool-call-parser qwen3_coder`: Qwen3-Coder / Qwen3.5 XML tool calls to OpenAI `tool_calls`.

Format (one block per call; a block may hold several functions):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    value (raw text, may span lines)
    </parameter>
    ...
    </function>
    </tool_call>

Values are typed by the tool's JSON schema (`schema_values.convert_value`) and arguments are rebuilt as
a JSON object text. As in SGLang's Qwen3CoderDetector a value also ends at the next `<parameter=` or at
`</function>`, one leading and one trailing newline of a value are dropped, and text between tags
inside a block is dropped. Text outside blocks is content. A `<tool_call>` block with no `<function=`
in it is not a call and stays in the content verbatim. Whitespace before the first call and between or
after calls is layout, not content (so a reply of calls only has empty content). A call cut off mid-way
(max_tokens) is reported with the parameters read so far (the last one possibly truncated) and its JSON
closed.

Streaming: a call's name is reported as soon as `<function=NAME>` is complete, each parameter once its
value is complete, the closing brace at `</function>`. The same state machine serves `parse`, so
streamed pieces concatenate to the non-streamed result however the text was chunked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sglang_tpu_qwen.parsers.markers import (
    FUNCTION_END,
    FUNCTION_START,
    PARAMETER_END,
    PARAMETER_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    find_first,
    partial_marker_len,
)
from sglang_tpu_qwen.parsers.schema_values import convert_value, property_schemas
from sglang_tpu_qwen.parsers.tool_calls import (
    ParsedToolCall,
    ToolCallDelta,
    ToolParseDelta,
    merge_call_deltas,
    tool_parameter_schemas,
)

_TEXT, _BLOCK, _FUNCTION = "text", "block", "function"
_VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)


class Qwen3CoderParser:
    """Incremental qwen3_coder tool-call parser for one output (see module docstring).

    Args:
        tools: the request's OpenAI `tools` (dicts or pydantic models); their `parameters` schemas type
            the values. A call to a function not listed is still reported, its values as strings.
    """

    name = "qwen3_coder"

    def __init__(self, tools: Sequence[Any] | None = None) -> None:
        self._schemas = tool_parameter_schemas(tools)
        self._state = _TEXT
        self._buf = ""
        self._block_raw = ""  # text of the open block while it has no function (returned as content if none)
        self._block_has_call = False
        self._next_index = 0
        self._index = -1  # index of the open call
        self._props: dict[str, Any] = {}
        self._num_params = 0
        self._at_gap = True  # at the start of the output or right after a call block
        self._gap = ""  # whitespace dropped before a block, returned if the block holds no call

    def feed(self, text: str) -> ToolParseDelta:
        """Add the next piece of (content-side) output text; return the content and call pieces now known."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ToolParseDelta:
        """End of output: flush held-back text and close a call that was cut off."""
        return self._drain(final=True)

    @classmethod
    def parse(cls, text: str, tools: Sequence[Any] | None = None) -> tuple[str, list[ParsedToolCall]]:
        """A complete output's content and tool calls."""
        parser = cls(tools)
        first, last = parser.feed(text), parser.finish()
        merged = merge_call_deltas(first.calls + last.calls)
        calls = [ParsedToolCall(index=d.index, name=d.name or "", arguments=d.arguments) for d in merged]
        return first.content + last.content, calls

    # ------------------------------------------------------------------ state machine
    def _drain(self, final: bool) -> ToolParseDelta:
        out = ToolParseDelta()
        while True:
            if self._state == _TEXT:
                if not self._read_text(out, final):
                    break
            elif self._state == _BLOCK:
                if not self._read_block(out, final):
                    break
            elif not self._read_function(out, final):
                break
        return out

    def _read_text(self, out: ToolParseDelta, final: bool) -> bool:
        if self._at_gap:
            # Whitespace before the first call or between / after calls is layout, not content.
            rest = self._buf.lstrip()
            if not rest or (not final and TOOL_CALL_START.startswith(rest) and rest != TOOL_CALL_START):
                if final:
                    self._buf = ""
                return False  # undecided until non-space text, a call or the end
            if rest.startswith(TOOL_CALL_START):  # kept aside: content again if the block is no call
                self._gap, self._buf = self._buf[: len(self._buf) - len(rest)], rest
            self._at_gap = False
        i = self._buf.find(TOOL_CALL_START)
        if i < 0:
            keep = 0 if final else partial_marker_len(self._buf, (TOOL_CALL_START,))
            out.content += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        out.content += self._buf[:i]
        self._buf = self._buf[i + len(TOOL_CALL_START) :]
        self._state, self._block_raw, self._block_has_call = _BLOCK, self._gap + TOOL_CALL_START, False
        self._gap = ""
        return True

    def _read_block(self, out: ToolParseDelta, final: bool) -> bool:
        """Inside `<tool_call>`, between functions."""
        hit = find_first(self._buf, (FUNCTION_START, TOOL_CALL_END))
        if hit is not None and hit[1] == FUNCTION_START:
            close = self._buf.find(">", hit[0] + len(FUNCTION_START))
            if close >= 0:
                self._open_call(self._buf[hit[0] + len(FUNCTION_START) : close].strip(), out)
                self._buf = self._buf[close + 1 :]
                self._state = _FUNCTION
                return True
            if final:  # cut off inside `<function=...`: no call
                return self._end_block_at_eof(out)
            self._keep_from(hit[0])  # wait for the rest of the name
            return False
        if hit is None:
            if final:
                return self._end_block_at_eof(out)
            keep = partial_marker_len(self._buf, (FUNCTION_START, TOOL_CALL_END))
            self._keep_from(len(self._buf) - keep)
            return False
        # </tool_call>: the block ends; without a function in it, it was never a call.
        end = hit[0] + len(TOOL_CALL_END)
        if not self._block_has_call:
            out.content += self._block_raw + self._buf[:end]
        self._buf = self._buf[end:]
        self._state, self._at_gap = _TEXT, self._block_has_call
        return True

    def _keep_from(self, start: int) -> None:
        """Move the block text before `start` out of the buffer (kept aside while the block has no call)."""
        self._block_raw += self._buf[:start]
        self._buf = self._buf[start:]

    def _end_block_at_eof(self, out: ToolParseDelta) -> bool:
        if not self._block_has_call:
            out.content += self._block_raw + self._buf
        self._buf = ""
        self._state = _TEXT
        return False

    def _open_call(self, name: str, out: ToolParseDelta) -> None:
        self._block_has_call, self._block_raw = True, ""
        self._index, self._next_index = self._next_index, self._next_index + 1
        self._props = property_schemas(self._schemas.get(name))
        self._num_params = 0
        out.calls.append(ToolCallDelta(index=self._index, name=name))

    def _close_call(self, out: ToolParseDelta) -> None:
        out.calls.append(ToolCallDelta(index=self._index, arguments="}" if self._num_params else "{}"))

    def _read_function(self, out: ToolParseDelta, final: bool) -> bool:
        """Inside `<function=NAME>`, between parameters."""
        hit = find_first(self._buf, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
        if hit is None:
            if final:
                self._close_call(out)
                self._buf, self._state = "", _TEXT
                return False
            keep = partial_marker_len(self._buf, (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
            self._buf = self._buf[len(self._buf) - keep :]  # text between tags is dropped
            return False
        start, marker = hit
        if marker == FUNCTION_END:
            self._close_call(out)
            self._buf, self._state = self._buf[start + len(FUNCTION_END) :], _BLOCK
            return True
        if marker == TOOL_CALL_END:  # </function> missing: the block's end closes the call too
            self._close_call(out)
            self._buf, self._state, self._at_gap = self._buf[start + len(TOOL_CALL_END) :], _TEXT, True
            return True
        name_end = self._buf.find(">", start + len(PARAMETER_START))
        value_end = None if name_end < 0 else find_first(self._buf, _VALUE_ENDS, name_end + 1)
        if value_end is None and not final:
            self._buf = self._buf[start:]  # wait for the whole parameter
            return False
        if name_end < 0:  # cut off inside `<parameter=...`
            self._close_call(out)
            self._buf, self._state = "", _TEXT
            return False
        name = self._buf[start + len(PARAMETER_START) : name_end].strip()
        if value_end is None:  # cut off inside the value: keep what was written, minus a partial tag
            raw = self._buf[name_end + 1 :]
            raw = raw[: len(raw) - partial_marker_len(raw, _VALUE_ENDS)]
            self._buf = ""
        else:
            raw = self._buf[name_end + 1 : value_end[0]]
            consumed = len(PARAMETER_END) if value_end[1] == PARAMETER_END else 0
            self._buf = self._buf[value_end[0] + consumed :]
        self._emit_parameter(name, _strip_one_newline(raw), out)
        return True

    def _emit_parameter(self, name: str, raw: str, out: ToolParseDelta) -> None:
        value = convert_value(raw, self._props.get(name))
        pair = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        out.calls.append(ToolCallDelta(index=self._index, arguments=("{" if not self._num_params else ", ") + pair))
        self._num_params += 1


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
