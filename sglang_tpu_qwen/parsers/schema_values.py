"""Typing a qwen3_coder parameter value (raw text between `<parameter=NAME>` tags) by the tool's JSON schema.

The model writes every value as bare text; the tool's `parameters` schema says what it means. A value is
kept as a string whenever the schema allows a string (so "03106" stays "03106"), parsed as an integer,
number or boolean when the schema says so, and as JSON (or a Python literal) for objects and arrays. A
value that does not parse as its declared type is kept as the raw string rather than guessed at. `null`
is None for any type, as in SGLang's qwen3_coder detector.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

_INTEGER_TYPES = ("integer", "int")
_NUMBER_TYPES = ("number", "float")
_BOOLEAN_TYPES = ("boolean", "bool")
_JSON_TYPES = ("object", "array")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema admits: `type` (a name or a list), `enum`/`const` values' types, and
    the members of `anyOf`/`oneOf`/`allOf`. Empty when the schema says nothing about types."""
    if not isinstance(schema, Mapping):
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    values = list(schema.get("enum") or [])
    if "const" in schema:
        values.append(schema["const"])
    types.update(_json_type(v) for v in values)
    for key in ("anyOf", "oneOf", "allOf"):
        for member in schema.get(key) or []:
            types |= schema_types(member)
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def convert_value(raw: str, schema: Any) -> Any:
    """The typed value of a raw parameter text under its property schema (`schema` None: the parameter is
    not in the tool's schema, and the text is kept as a string).

    Precedence when a schema admits several types: string, integer, number, boolean, object/array.
    """
    if raw.strip().lower() == "null":
        return None
    types = schema_types(schema)
    if schema is None or not types or "string" in types:
        return raw
    text = raw.strip()
    if any(t in types for t in _INTEGER_TYPES):
        try:
            return int(text)
        except ValueError:
            pass
    if any(t in types for t in _NUMBER_TYPES):
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if not math.isfinite(number):  # inf / nan are not JSON numbers
                return raw
            # "5" under a number schema is 5, not 5.0, as a JSON client would write it.
            looks_integral = not any(c in text for c in ".eE")
            return int(number) if looks_integral and number.is_integer() else number
    if any(t in types for t in _BOOLEAN_TYPES) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if any(t in types for t in _JSON_TYPES):
        try:
            return json.loads(text)
        except ValueError:
            pass
        try:  # models sometimes write Python literals ({'a': 1}, [True])
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw


def property_schemas(parameters: Any) -> dict[str, Any]:
    """`properties` of a tool's `parameters` schema ({} when absent or malformed)."""
    if not isinstance(parameters, Mapping):
        return {}
    props = parameters.get("properties")
    return dict(props) if isinstance(props, Mapping) else {}
