"""GrammarSpec: what a request constrains its output to, and the API fields that produce one.

A request carries at most one constraint, named by its SGLang `sampling_params` key: `regex`, `json_schema`
(a JSON Schema as a string), `ebnf` (GBNF, llama.cpp's EBNF dialect, root rule `root`) or `structural_tag`
(xgrammar's structural tag JSON, or SGLang's `{"structures": [...], "triggers": [...]}` form). The OpenAI
routes map `response_format` onto the same keys (`response_format_constraint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONSTRAINT_KEYS = ("regex", "json_schema", "ebnf", "structural_tag")

# SGLang's OpenAI layer sends this schema for response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` is one of CONSTRAINT_KEYS, `text` its source. Hashable: the compile cache key."""

    kind: str
    text: str


def spec_from_fields(fields: dict[str, Any]) -> GrammarSpec | None:
    """The constraint among `fields` (keys of CONSTRAINT_KEYS, None values ignored), or None.

    A dict or list value of `json_schema` / `structural_tag` is serialised to JSON text.
    Raises ValueError when more than one constraint is set or a value is not text.
    """
    present = {k: fields[k] for k in CONSTRAINT_KEYS if fields.get(k) is not None}
    if len(present) > 1:
        raise ValueError(f"only one constraint may be set per request, got {', '.join(present)} "
                         "(an OpenAI response_format counts as json_schema or structural_tag)")
    if not present:
        return None
    kind, value = next(iter(present.items()))
    if kind in ("json_schema", "structural_tag") and isinstance(value, (dict, list)):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string, got {type(value).__name__}")
    return GrammarSpec(kind, value)


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, str]:
    """SGLang sampling_params constraint fields for an OpenAI `response_format` ({} for none / "text").

    `json_object` allows any JSON object; `json_schema` takes `json_schema.schema` (any JSON object when
    absent); `structural_tag` passes the whole object on, as SGLang does.
    Raises ValueError for an unknown type or a malformed `json_schema`.
    """
    if not response_format:
        return {}
    kind = response_format.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise ValueError(
        f"response_format.type must be one of text, json_object, json_schema, structural_tag; got {kind!r}")


def structural_tag_object(text: str) -> dict[str, Any]:
    """A structural tag in xgrammar's current form (`{"type": "structural_tag", "format": {...}}`).

    SGLang's older form `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (also what
    response_format {"type": "structural_tag", ...} carries) becomes a `triggered_tags` format.
    Raises ValueError for text that is not a JSON object or a malformed older form.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("a structural tag must be a JSON object")
    if "structures" not in obj:
        return obj
    structures, triggers = obj.get("structures"), obj.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
        isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str) for s in structures
    ):
        raise ValueError("structures must be a list of {begin, schema, end} and triggers a list of strings")
    tags = []
    for s in structures:
        schema = s.get("schema", {})
        if isinstance(schema, str):
            schema = json.loads(schema)
        tags.append({"begin": s["begin"], "content": {"type": "json_schema", "json_schema": schema}, "end": s["end"]})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
