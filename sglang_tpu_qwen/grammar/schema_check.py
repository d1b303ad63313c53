"""JSON-Schema keywords a grammar backend accepts but does not enforce: refused up front (a 400 naming them).

Measured on the compiled grammars (tests/test_grammar_keywords.py feeds a satisfying and a violating
instance of every keyword through each backend's matcher). xgrammar 0.2.x silently drops the keywords and
combinations below and would emit output that violates the schema; llguidance refuses everything it does
not implement itself ("Unimplemented keys"), so it needs no list. Both get a clear refusal of a `$ref`
outside the schema (nothing is fetched). Keywords of the content vocabulary
(contentEncoding, contentMediaType, contentSchema) and annotations are not assertions in JSON Schema
2020-12 and pass.
"""

from __future__ import annotations

from typing import Any

# Keywords xgrammar ignores wherever they appear.
XGRAMMAR_IGNORED = ("patternProperties", "dependentRequired", "dependentSchemas", "dependencies", "contains",
                    "minContains", "maxContains", "uniqueItems", "not", "if", "then", "else", "$dynamicRef")

# Where a schema holds subschemas: keyword -> "one" (a schema), "list" (schemas), "map" (name -> schema).
_SUBSCHEMAS = {
    "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
    "dependentSchemas": "map", "additionalProperties": "one", "unevaluatedProperties": "one",
    "propertyNames": "one", "items": "one_or_list", "prefixItems": "list", "additionalItems": "one",
    "unevaluatedItems": "one", "contains": "one", "anyOf": "list", "oneOf": "list", "allOf": "list",
    "not": "one", "if": "one", "then": "one", "else": "one",
}


def _children(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, kind in _SUBSCHEMAS.items():
        value = schema.get(key)
        if value is None:
            continue
        if kind == "map" and isinstance(value, dict):
            out += [(f"{key}.{name}", sub) for name, sub in value.items()]
        elif kind in ("list", "one_or_list") and isinstance(value, list):
            out += [(f"{key}[{i}]", sub) for i, sub in enumerate(value)]
        elif kind in ("one", "one_or_list"):
            out.append((key, value))
    return out


def _common_problem(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"keyword '$ref' to {ref!r}: only references inside the schema ('#/...') are supported"
    return None


def _xgrammar_problem(schema: dict[str, Any]) -> str | None:
    for key in XGRAMMAR_IGNORED:
        if key in schema:
            return f"keyword '{key}' is not enforced by the xgrammar grammar backend"
    if "allOf" in schema and isinstance(schema["allOf"], list) and len(schema["allOf"]) > 1:
        return "keyword 'allOf' with more than one schema is not enforced by the xgrammar grammar backend"
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [n for n in schema.get("required") or [] if n not in props]
    if missing:
        return (f"keyword 'required' names {missing[0]!r}, which is not in 'properties': the xgrammar grammar "
                "backend enforces 'required' only for listed properties")
    for length in ("minLength", "maxLength"):
        for other in ("pattern", "format"):
            if length in schema and other in schema:
                return (f"keyword '{length}' together with '{other}' is not enforced by the xgrammar grammar "
                        "backend")
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "keyword 'multipleOf' is enforced by the xgrammar grammar backend only with \"type\": \"integer\""
    return None


def unenforced_keyword(schema: Any, backend: str) -> str | None:
    """The first keyword (with its path) of `schema` that `backend` would accept without enforcing it, else None.

    Args:
        schema: the parsed JSON Schema (a dict; a boolean schema has no keywords).
        backend: "xgrammar" or "llguidance".
    """
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _common_problem(node) or (_xgrammar_problem(node) if backend == "xgrammar" else None)
        if problem is not None:
            return f"{problem} (at {path or 'the root'})"
        stack += [(f"{path}.{p}" if path else p, sub) for p, sub in reversed(_children(node))]
    return None
