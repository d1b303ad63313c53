"""JSON strings without raw control characters under xgrammar (JSON forbids U+0000-U+001F unescaped in strings).

Measured on xgrammar 0.2.x (tests/test_grammar_strings.py): a string bounded by `minLength` / `maxLength`, and a
`pattern` that names a control character (`\\t`, `[\\x00-\\x1f]`), let the raw character into the string, so
the answer fails `json.loads(strict=True)`. Plain strings, `format`, `enum` / `const` and patterns without an
explicit control character stay clean; llguidance keeps every string clean.

- Length bounds are rewritten for xgrammar as the equivalent pattern over characters that need no escape
  (`[^"\\\\\\x00-\\x1f]{min,max}`): each character is one JSON code point, so the bounds are kept; a bounded
  string then holds no quote or backslash (xgrammar's patterns take no escapes), which every schema allows.
- A pattern that can match a control character is refused (a 400 naming it): it could only be met raw.
"""

from __future__ import annotations

import copy
import re
from typing import Any

try:  # Python's own regex parser: the pattern's literals and class ranges
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_SAFE_CHAR = r'[^"\\\x00-\x1f]'
_CONTROL_MAX = 0x1F


def _walk(schema: Any, visit: Any) -> None:
    """Call visit(dict) on `schema` and every subschema (any dict value or list item under a dict)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            visit(node)
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)


def _matches_control(parsed: Any, negated: bool = False) -> bool:
    """Whether a parsed regex names a control character explicitly (a literal, or a class range reaching
    below U+0020). Negated classes are left alone: xgrammar keeps control characters out of them."""
    for op, arg in parsed:
        name = str(op)
        if name == "LITERAL" and arg <= _CONTROL_MAX and not negated:
            return True
        if name == "RANGE" and arg[0] <= _CONTROL_MAX and not negated:
            return True
        if name == "IN":
            is_negated = any(str(o) == "NEGATE" for o, _ in arg)
            if _matches_control(arg, negated=is_negated):
                return True
        elif name in ("SUBPATTERN",):
            if _matches_control(arg[-1]):
                return True
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            if _matches_control(arg[2]):
                return True
        elif name == "BRANCH":
            if any(_matches_control(b) for b in arg[1]):
                return True
        elif name in ("ASSERT", "ASSERT_NOT"):
            if _matches_control(arg[1]):
                return True
    return False


def control_pattern(schema: Any) -> str | None:
    """The first `pattern` in `schema` that can match a control character (xgrammar would emit it raw), else None.
    A pattern Python cannot parse is left to the backend's own parser."""
    found: list[str] = []

    def visit(node: dict) -> None:
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not found:
            try:
                parsed = _sre_parse.parse(pattern)
            except (re.error, RecursionError, OverflowError):
                return
            if _matches_control(parsed):
                found.append(pattern)

    _walk(schema, visit)
    return found[0] if found else None


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of `schema` where each string schema (`type` "string", a list holding it, or no `type`) with
    `minLength` / `maxLength` (and no pattern or format, which schema_check refuses alongside them) carries the
    same bounds as a pattern of characters that need no escape (a pattern, like the length keywords, applies to
    string values only). Other schemas and unbounded strings are unchanged."""
    out = copy.deepcopy(schema)

    def visit(node: dict) -> None:
        if not ("minLength" in node or "maxLength" in node) or "pattern" in node or "format" in node:
            return
        kind = node.get("type")
        if kind is not None and kind != "string" and not (isinstance(kind, list) and "string" in kind):
            return
        lo, hi = node.get("minLength", 0), node.get("maxLength")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
            return  # a malformed bound: the backend reports it
        node.pop("minLength", None)
        node.pop("maxLength", None)
        if kind is None:  # xgrammar reads a length-bounded schema without a type as a string
            node["type"] = "string"
        bound = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo}}}{_SAFE_CHAR}*"
        node["pattern"] = f"^{_SAFE_CHAR}{bound}$"

    _walk(out, visit)
    return out
