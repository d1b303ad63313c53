"""The whitespace JSON-Schema output may hold between tokens (SGLang's --constrained-json-whitespace-pattern).

Unbounded whitespace lets a model loop on whitespace tokens until max_new_tokens (seen with
`{"a": {"enum": [1]}}`); the default allows at most DEFAULT_MAX_WHITESPACE whitespace characters in a row,
enough for `{"a": 1}` spacing and a newline with shallow indentation. `--constrained-json-disable-any-whitespace`
makes the output compact. A pattern given by flag goes to llguidance as is; xgrammar takes only a bounded
or unbounded run of JSON whitespace (`[ \\n\\t]*`, `[ \\n]{0,4}`, `{,N}` forms), anything else is refused at
startup.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MAX_WHITESPACE = 8
DEFAULT_JSON_WHITESPACE = rf"[ \n\t]{{0,{DEFAULT_MAX_WHITESPACE}}}"
_JSON_WS = set(" \n\r\t")
_RUN = re.compile(r"^\[(?P<chars>[^\]]+)\](?P<count>\*|\+|\{0?,(?P<max>\d+)\})$")


@dataclass(frozen=True)
class JsonWhitespace:
    """Resolved whitespace rule for JSON Schema grammars.

    Attributes:
        compact: no free whitespace at all (`--constrained-json-disable-any-whitespace`).
        pattern: the regex of one whitespace run (llguidance's `whitespace_pattern`); None with compact.
        max_count: longest whitespace run (xgrammar's `max_whitespace_cnt`); None: unbounded.
    """

    compact: bool
    pattern: str | None
    max_count: int | None


def as_json_whitespace(value: bool | JsonWhitespace, backend: str = "xgrammar") -> JsonWhitespace:
    """A JsonWhitespace from the older boolean form (True: the default bounded runs, False: compact)."""
    if isinstance(value, JsonWhitespace):
        return value
    return resolve_json_whitespace(None, disable_any_whitespace=not value, backend=backend)


def _unescape(chars: str) -> set[str]:
    return set(chars.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r").replace("\\x20", " "))


def resolve_json_whitespace(pattern: str | None, disable_any_whitespace: bool = False,
                            backend: str = "xgrammar") -> JsonWhitespace:
    """The rule for the flags; raises ValueError for a pattern `backend` cannot enforce."""
    if disable_any_whitespace:
        return JsonWhitespace(True, None, None)
    if pattern is None:
        return JsonWhitespace(False, DEFAULT_JSON_WHITESPACE, DEFAULT_MAX_WHITESPACE)
    if backend == "llguidance":
        re.compile(pattern)  # a bad regex fails at startup (re.error is a ValueError)
        return JsonWhitespace(False, pattern, None)
    m = _RUN.match(pattern)
    chars = _unescape(m.group("chars")) if m else set()
    if m is None or not chars <= _JSON_WS:
        raise ValueError(f"--constrained-json-whitespace-pattern {pattern!r}: the xgrammar backend takes only a run "
                         "of JSON whitespace such as '[ \\n\\t]*' or '[ \\n\\t]{0,4}' (use --grammar-backend "
                         "llguidance for another pattern)")
    if chars != _JSON_WS:
        logger.warning("xgrammar allows every JSON whitespace character in a run; %r bounds only its length", pattern)
    max_count = int(m.group("max")) if m.group("max") is not None else None
    return JsonWhitespace(False, pattern, max_count)
