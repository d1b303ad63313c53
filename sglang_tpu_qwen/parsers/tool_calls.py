"""What a tool-call parser returns: content text and tool-call pieces, streamed or whole.

Streaming follows SGLang's OpenAI deltas: a call's first piece carries its name (the server adds the
call id), later pieces carry fragments of its JSON `arguments`; the fragments of a call concatenate to
the same arguments string a non-streamed reply carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallDelta:
    """One piece of tool call number `index` (0-based within the reply): `name` on its first piece."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolParseDelta:
    """Output of one `feed`/`finish`: plain content text and tool-call pieces, in output order."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedToolCall:
    """A whole tool call: the function name and its arguments as a JSON object text."""

    index: int
    name: str
    arguments: str


def merge_call_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """Pieces merged per call index (first name kept, arguments concatenated), ordered by index."""
    merged: dict[int, ToolCallDelta] = {}
    for d in deltas:
        cur = merged.setdefault(d.index, ToolCallDelta(index=d.index))
        if cur.name is None:
            cur.name = d.name
        cur.arguments += d.arguments
    return [merged[i] for i in sorted(merged)]


def tool_parameter_schemas(tools: Sequence[Any] | None) -> dict[str, Any]:
    """{function name: its `parameters` JSON schema} from OpenAI `tools` (dicts or pydantic models)."""
    out: dict[str, Any] = {}
    for tool in tools or []:
        spec = tool.model_dump() if hasattr(tool, "model_dump") else tool
        if not isinstance(spec, Mapping):
            continue
        fn = spec.get("function", spec)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out
