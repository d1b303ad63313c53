"""Server-sent events: the one streamer behind every streamed route, and the native /generate chunks.

The engine streams increments to the server (`Engine.async_generate(stream=True, stream_deltas=True)`: each
chunk holds the text, output_ids and output logprobs new since the previous chunk of its index; counts in
meta_info are totals). A route's renderer turns an increment into SSE events; nothing it does per chunk
grows with the reply, so a chunk costs the same at token 4,000 as at token 10 (bench/stream_chunks.py
measures it). The only exception is SGLang's native wire format itself: a /generate chunk carries the
cumulative text and output_ids, which `NativeChunks` keeps as JSON-encoded bytes and copies, never re-encodes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from sglang_tpu_qwen.engine.io.errors import failed_status
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.errors import stream_error_event

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"

# One engine increment -> the SSE events to send for it (encoded, see `sse`).
Render = Callable[[dict], Iterable[bytes]]


def sse(payload: Any) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (UTF-8, non-ASCII characters unescaped)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def stream_response(engine: Engine, rids: str | list[str], first: dict | None, rest: AsyncIterator[dict],
                    render: Render, *, openai: bool,
                    closing: Callable[[], Iterable[bytes]] | None = None) -> StreamingResponse:
    """The SSE reply of a streamed call: `render(chunk)` for each engine increment, then `closing()` (e.g. a
    usage chunk) once every member finished, then `data: [DONE]`.

    A request the server failed ends the stream with an error event (`stream_error_event`, OpenAI or native
    shape) instead of its last chunk, and the call's requests are aborted; so does an exception while
    streaming (reported inside the stream, as SGLang does). A client that disconnects closes the body
    generator, whose `finally` aborts the requests.
    """

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            chunk = first
            while chunk is not None:
                reason = chunk["meta_info"]["finish_reason"]
                if failed_status(reason) is not None:
                    yield sse(stream_error_event(reason, openai=openai))
                    break
                for event in render(chunk):
                    yield event
                chunk = await anext(rest, None)
            else:
                for event in closing() if closing is not None else ():
                    yield event
                finished = True
        except Exception as e:  # engine failure mid-stream: reported inside the stream, as SGLang does
            logger.exception("stream failed")
            yield sse(stream_error_event({"message": str(e), "status_code": 500}, openai=openai))
        finally:
            if not finished:
                engine_calls.abort_all(engine, rids)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")


def add_logprob_length(meta: dict, count: int | None = None) -> None:
    """SGLang's `output_token_logprobs_length`: output tokens with a logprob so far (when logprobs are on);
    `count` is that total for a stream chunk whose list holds only its new tokens."""
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"]) if count is None else count


@dataclass
class _SentSoFar:
    """What one batch member's previous /generate chunks carried."""

    logprobs: int = 0  # output tokens with a logprob
    text_json: bytearray = field(default_factory=bytearray)  # the text so far, JSON-escaped, without quotes
    ids_json: bytearray = field(default_factory=bytearray)  # the output ids so far, as "1, 2, 3"


class NativeChunks:
    """Renders the engine's increments as SGLang 0.5.23's streamed /generate events.

    Every event's `output_token_logprobs` / `output_top_logprobs` hold only the tokens new since the previous
    event of the same index, and `output_token_logprobs_length` counts all of them so far (what
    sglang.test.test_programs.test_stream_logprobs and the frontend's meta-info merging expect). `text` and
    `output_ids` are cumulative, or (`incremental`: --incremental-streaming-output) the increments.

    The cumulative event is the bytes `json.dumps` gives for the reply dict ({"text", "output_ids",
    "meta_info", "index"}, in that order), built by appending each increment's encoding to the index's
    encoded text and ids: JSON escapes a string character by character, so the encodings concatenate.
    """

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self._sent: dict[int, _SentSoFar] = {}

    def __call__(self, chunk: dict) -> list[bytes]:
        """The event (one) for one engine increment; adds output_token_logprobs_length to its meta_info."""
        index = chunk.get("index", 0)
        sent = self._sent.setdefault(index, _SentSoFar())
        meta = chunk["meta_info"]
        if "output_token_logprobs" in meta:
            sent.logprobs += len(meta["output_token_logprobs"])
            add_logprob_length(meta, sent.logprobs)
        if self.incremental:
            return [sse(chunk)]
        sent.text_json += json.dumps(chunk["text"], ensure_ascii=False)[1:-1].encode()
        ids = chunk["output_ids"]
        if ids:
            sent.ids_json += (b", " if sent.ids_json else b"") + ", ".join(map(str, ids)).encode()
        # One join: the cumulative parts are copied once into the event, never re-encoded.
        return [b"".join((b'data: {"text": "', sent.text_json, b'", "output_ids": [', sent.ids_json,
                          b'], "meta_info": ', json.dumps(meta, ensure_ascii=False).encode(),
                          b', "index": ', str(index).encode(), b"}\n\n"))]


__all__ = ["SSE_DONE", "NativeChunks", "Render", "add_logprob_length", "sse", "stream_response"]
