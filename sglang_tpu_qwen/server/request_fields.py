"""The PD routing fields of a request body (native /generate and OpenAI bodies alike)."""

from __future__ import annotations

from typing import Any

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def bootstrap_kwargs(body: Any) -> dict[str, Any]:
    """`bootstrap_host/port/room` of a parsed body as Engine.async_generate keywords; {} when none is set
    (so a plain request passes no PD arguments at all)."""
    values = {name: getattr(body, name, None) for name in BOOTSTRAP_FIELDS}
    return values if any(v is not None for v in values.values()) else {}
