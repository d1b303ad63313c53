"""Request logging behind `--log-requests` (SGLang's flag): off by default, so the server logs no prompt
or output text unless an operator asks for it.

`--log-requests-level` as SGLang defines it (`srt/utils/request_logger.py`):
  0: metadata only (rid, prompt / output token counts, finish reason), no sampling parameters;
  1: metadata and sampling parameters;
  2: metadata, sampling parameters and the input / output, each cut to 2048 characters;
  3: everything, uncut.
Lines go to the `sglang_tpu_qwen.request` logger at INFO: "Receive: ..." when a call reaches the engine,
"Finish: ..." for each finished reply (also for every sample of a batch or stream).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine

logger = logging.getLogger("sglang_tpu_qwen.request")

PARTIAL_CHARS = 2048  # level 2 cut, SGLang's max_length


def enabled(engine: Engine) -> int | None:
    """The logging level of this engine's server, or None when --log-requests is off."""
    args = getattr(engine, "server_args", None)
    if args is None or not getattr(args, "log_requests", False):
        return None
    return int(getattr(args, "log_requests_level", 2))


def _cut(value: Any, level: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if level < 3 and len(text) > PARTIAL_CHARS:
        return text[:PARTIAL_CHARS] + f"...({len(text) - PARTIAL_CHARS} more chars)"
    return text


def _count(prompt: Any) -> int | str:
    if isinstance(prompt, str):
        return f"{len(prompt)} chars"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return f"batch of {len(prompt)}"
    return len(prompt) if isinstance(prompt, list) else 0


def log_received(engine: Engine, kwargs: dict[str, Any]) -> None:
    """Log one engine call (the keyword arguments of `Engine.async_generate`) if --log-requests is on."""
    level = enabled(engine)
    if level is None:
        return
    prompt = kwargs.get("text") if kwargs.get("text") is not None else kwargs.get("input_ids")
    parts = [f"rid={kwargs.get('rid')!r}", f"stream={bool(kwargs.get('stream'))}", f"prompt={_count(prompt)}"]
    images = kwargs.get("images")
    if images:  # how many, never their pixels
        parts.append(f"images={sum(len(i) if isinstance(i, list) else 1 for i in images)}")
    if level >= 1:
        parts.append(f"sampling_params={_cut(kwargs.get('sampling_params'), level)}")
    if level >= 2:
        parts.append(f"input={_cut(prompt, level)}")
    logger.info("Receive: %s", ", ".join(parts))


def log_finished(engine: Engine, reply: Any) -> None:
    """Log every finished reply dict in `reply` (a dict, a list of them, or a stream chunk)."""
    level = enabled(engine)
    if level is None:
        return
    for out in reply if isinstance(reply, list) else [reply]:
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        if meta.get("finish_reason") is None:
            continue
        parts = [f"rid={meta.get('id')!r}", f"finish_reason={json.dumps(meta.get('finish_reason'))}",
                 f"prompt_tokens={meta.get('prompt_tokens')}", f"completion_tokens={meta.get('completion_tokens')}",
                 f"cached_tokens={meta.get('cached_tokens')}"]
        if level >= 2:
            parts.append(f"output={_cut(out.get('text', ''), level)}")
        logger.info("Finish: %s", ", ".join(parts))


async def logged_stream(engine: Engine, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Pass a stream's increments (server/sse.py) through, logging each finished member with its whole text
    (only when --log-requests is on: the text pieces are kept only then)."""
    pieces: dict[int, list[str]] = {}
    async for chunk in chunks:
        text = pieces.setdefault(chunk.get("index", 0), [])
        text.append(chunk.get("text", ""))
        if chunk["meta_info"].get("finish_reason") is not None:
            log_finished(engine, {**chunk, "text": "".join(text)})
        yield chunk
