"""Calling the Engine from a route: request ids, client-disconnect aborts, opening a stream.

SGLang frees a request's memory when its HTTP client goes away (a closed stream, or a client that
stops waiting for a non-streamed reply); these helpers do the same through `engine.abort(rid)`.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from sglang_tpu_qwen.server import request_log

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine

# How often a non-streamed request checks whether its client is still connected (seconds).
_DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The HTTP client went away before the reply was ready; the request was aborted."""


def new_rid() -> str:
    """A fresh request id (32 hex chars, like SGLang's uuid4().hex)."""
    return uuid.uuid4().hex


def make_rids(rid: str | list[str] | None, batch_size: int | None) -> str | list[str]:
    """Request ids for a single request (`batch_size` None) or a batch.

    A string given for a batch is used as a prefix (`{rid}_{i}`), as SGLang does.
    Raises ValueError when a list of ids does not match the batch size.
    """
    if batch_size is None:
        if isinstance(rid, list):
            raise ValueError("rid must be a string for a single request")
        return rid or new_rid()
    if isinstance(rid, list):
        if len(rid) != batch_size:
            raise ValueError(f"rid has {len(rid)} entries for a batch of {batch_size}")
        return rid
    base = rid or new_rid()
    return [f"{base}_{i}" for i in range(batch_size)]


def abort_all(engine: Engine, rids: str | list[str]) -> None:
    """Abort every request id of a call (a single id or a batch's list)."""
    for rid in [rids] if isinstance(rids, str) else rids:
        engine.abort(rid)


async def _start(engine: Engine, kwargs: dict[str, Any]) -> Any:
    request_log.log_received(engine, kwargs)  # a no-op unless --log-requests
    result = engine.async_generate(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


async def generate_once(engine: Engine, request: Request, rids: str | list[str], **kwargs: Any) -> Any:
    """Run a non-streamed generation; abort it and raise ClientDisconnected if the client leaves.

    Returns the engine's reply (a dict, or a list for a batch / n > 1). Engine errors propagate.
    """
    task = asyncio.ensure_future(_start(engine, {**kwargs, "rid": rids, "stream": False}))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                request_log.log_finished(engine, task.result())
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    except BaseException:
        # Client gone, or this handler cancelled (server shutting down): free the request's memory.
        if not task.done():
            task.cancel()
            abort_all(engine, rids)
        raise


async def open_stream(engine: Engine, rids: str | list[str], **kwargs: Any) -> tuple[dict | None, AsyncIterator]:
    """Start a streamed generation and wait for its first chunk.

    The chunks are the engine's increments (`stream_deltas`: text, output_ids and output logprobs new since
    the previous chunk of the same index); server/sse.py renders them.

    Waiting for the first chunk lets an invalid request (engine.errors.InvalidRequestError) become a
    plain 400 reply instead of an error inside an already-started event stream.
    Returns (first chunk or None when the stream is empty, iterator over the remaining chunks).
    """
    stream = await _start(engine, {**kwargs, "rid": rids, "stream": True, "stream_deltas": True})
    it = aiter(request_log.logged_stream(engine, aiter(stream)) if request_log.enabled(engine) is not None
                else stream)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return None, it
    except BaseException:
        abort_all(engine, rids)
        raise
    return first, it

