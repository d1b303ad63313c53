"""The text markers of Qwen3 / Qwen3.5 output and the hold-back rule streaming parsers share.

Each marker is one token of the Qwen3.5 vocabulary (`</think>` is id 248069, `<tool_call>` 248058), but a
model may also spell it out over several ordinary tokens, so the parsers work on text and hold back any
tail that could still grow into a marker.
"""

from __future__ import annotations

# The same rule as for stop strings: a tail that may still complete a marker waits for the next chunk.
from sglang_tpu_qwen.tokenizer.detokenizer import partial_stop_len as partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"



def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """(index, marker) of the first occurrence in `text[start:]` of any of `markers`, or None.

    No Qwen marker contains another, so the first complete occurrence in a prefix of the output is also
    the first in the whole output: parsing does not depend on how the output was chunked.
    """
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, marker)
    return best


__all__ = [
    "FUNCTION_END", "FUNCTION_START", "PARAMETER_END", "PARAMETER_START", "THINK_END", "THINK_START",
    "TOOL_CALL_END", "TOOL_CALL_START", "find_first", "partial_marker_len",
]
