"""The decoding constraint behind `tool_choice: "required"` or a named function: an EBNF (GBNF, root rule
`root`, as `sampling_params.ebnf` takes it) over the qwen3_coder call format.

    root ::= [reasoning] call ("\\n" call)*        (one call only for a named function or
                                                    parallel_tool_calls false)
    call ::= "<tool_call>\\n<function=NAME>\\n" params "</function>\\n</tool_call>"
    param ::= "<parameter=ARG>\\n" value "\\n</parameter>\\n"

With thinking on (the template opened `<think>`), the output first finishes the reasoning: text without
`<` then `</think>\\n\\n`; with thinking off the call comes first. Parameters follow the schema's
`properties` order, those in `required` mandatory, the others optional. Values by type: integer,
number, boolean and null as JSON spells them, string enums/consts as their literals, objects and arrays
as JSON, any other string as text without `<`. Keeping `<` out of free text is what makes every output
the grammar allows parse back (qwen3_coder.py) into exactly the call it spells: no value can contain
`</parameter>` or another tag. Nested objects are not checked against their sub-schemas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sglang_tpu_qwen.parsers.schema_values import property_schemas, schema_types
from sglang_tpu_qwen.parsers.tool_calls import tool_parameter_schemas

# Shared value rules (GBNF). JSON strings exclude raw '<' (write \u003c) for the reason above.
_VALUE_RULES = r"""
text ::= [^<]*
integer ::= "-"? [0-9]+
number ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
boolean ::= "true" | "false"
null ::= "null"
json-value ::= json-object | json-array | json-string | number | boolean | null
json-object ::= "{" ws (json-string ws ":" ws json-value ws ("," ws json-string ws ":" ws json-value ws)*)? "}"
json-array ::= "[" ws (json-value ws ("," ws json-value ws)*)? "]"
json-string ::= "\"" ([^"\\<\x00-\x1f] | "\\" (["\\/bfnrt] | "u" hex hex hex hex))* "\""
hex ::= [0-9a-fA-F]
ws ::= [ \t\n]*
"""

_TYPE_RULES = {
    "string": "text", "integer": "integer", "number": "number", "boolean": "boolean", "null": "null",
    "object": "json-object", "array": "json-array",
}


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def value_rule(schema: Any) -> str:
    """The right-hand side for one parameter's value under its property schema."""
    if isinstance(schema, Mapping):
        choices = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
        if choices and all(isinstance(c, str) for c in choices):
            return " | ".join(literal(c) for c in dict.fromkeys(choices))
    types = schema_types(schema)
    if not types or "string" in types:
        return "text"  # the parser keeps the raw text of a string-typed (or untyped) value
    rules = [_TYPE_RULES[t] for t in ("integer", "number", "boolean", "null", "object", "array") if t in types]
    return " | ".join(dict.fromkeys(rules)) or "text"


def tool_call_ebnf(tools: Sequence[Any], function: str | None = None, *, thinking: bool = True,
                   parallel: bool = True) -> str:
    """The grammar forcing tool calls (see module docstring).

    Args:
        tools: the request's OpenAI tools (dicts or pydantic models).
        function: the named function of `tool_choice`, or None for "required" (any of `tools`).
        thinking: the generation prompt left a `<think>` block open.
        parallel: allow several calls (ignored for a named function: exactly one call).

    Raises:
        ValueError: no tools, or `function` is not among them.
    """
    schemas = tool_parameter_schemas(tools)
    if not schemas:
        raise ValueError("tool_choice requires at least one tool in `tools`")
    if function is not None and function not in schemas:
        raise ValueError(f"tool_choice names function {function!r}, which is not in `tools`")
    names = [function] if function is not None else list(schemas)
    lines = []
    calls = " | ".join(f"call-{i}" for i in range(len(names)))
    many = parallel and function is None
    lines.append(f"root ::= {'reasoning ' if thinking else ''}call" + (' ("\\n" call)*' if many else ""))
    if thinking:
        lines.append('reasoning ::= [^<]* "</think>\\n\\n"')
    lines.append(f"call ::= {calls}")
    for i, name in enumerate(names):
        params = property_schemas(schemas[name])
        required = _required(schemas[name])
        parts = []
        for j, (arg, arg_schema) in enumerate(params.items()):
            lines.append(f"param-{i}-{j} ::= {literal(f'<parameter={arg}>' + chr(10))} ({value_rule(arg_schema)}) "
                         f"{literal(chr(10) + '</parameter>' + chr(10))}")
            parts.append(f"param-{i}-{j}" if arg in required else f"param-{i}-{j}?")
        body = " ".join([literal(f"<tool_call>\n<function={name}>\n"), *parts,
                         literal("</function>\n</tool_call>")])
        lines.append(f"call-{i} ::= {body}")
    return "\n".join(lines) + "\n" + _VALUE_RULES.lstrip("\n")


def _required(parameters: Any) -> set[str]:
    if not isinstance(parameters, Mapping):
        return set()
    req = parameters.get("required")
    return {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
