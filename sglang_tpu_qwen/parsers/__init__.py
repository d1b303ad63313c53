"""Output parsers of the OpenAI chat route: reasoning split (`--reasoning-parser`) and tool calls
(`--tool-call-parser`), plus the decoding constraint that forces a well-formed tool call.

Pure Python over text; one concept per module:
  markers.py        Qwen's tag strings and the hold-back rule for partial tags
  reasoning.py      qwen3 reasoning parser (text before `</think>` -> reasoning_content)
  schema_values.py  typing a parameter's raw text by the tool's JSON schema
  tool_calls.py     tool-call result types
  qwen3_coder.py    qwen3_coder tool-call parser (`<tool_call><function=...>` -> tool_calls)
  chat_output.py    both parsers over one choice, streamed or whole; the parser-name registries
  tool_grammar.py   the EBNF that tool_choice "required" / a named function constrains decoding with
"""

from sglang_tpu_qwen.parsers.chat_output import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatDelta,
    ChatOutputParser,
    ParsedChatMessage,
)

__all__ = ["REASONING_PARSERS", "TOOL_CALL_PARSERS", "ChatDelta", "ChatOutputParser", "ParsedChatMessage"]
