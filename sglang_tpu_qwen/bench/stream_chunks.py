"""Server-side host time per streamed chunk, early vs late in one long stream.

What it measures: one greedy stream of `--tokens` tokens (ignore_eos, max_new_tokens = --tokens, one request,
stream_interval 1 so one chunk per token) from a real HTTP server on 127.0.0.1 over an in-process Engine
(embedded model on CPU by default, overlap scheduling off so the scheduler's host work does not share the
cores with a running model step), on the native /generate route and on /v1/completions. Per chunk it times
the server's host work on that chunk, excluding the model step:

  scheduler: `OutputProcessor.accept_token` on the scheduler thread (logprob, detokenize, stop checks, the
             chunk's reply dict, handing it to the event loop);
  http:      one step of the SSE body generator (the engine chunk taken from its queue, rendered, encoded),
             less the time that step spent waiting for the engine's next chunk (the model step).

Times are the CPU time of the thread doing the work (`time.thread_time`), so waiting for the GIL or for
a core on a shared host does not count; the client runs in a child process. It prints the median and mean
of each for the first and the last `--window` chunks. Work proportional to the reply's length shows as late
chunks costing more than early ones. The same script runs on an older checkout (it wraps only
OutputProcessor.accept_token, Engine.async_generate and starlette's StreamingResponse), so before/after
figures come from one command.

Usage: `python -m sglang_tpu_qwen.bench.stream_chunks --tokens 4000 --window 100`; one JSON line per route
follows the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


class _Timings:
    """Per-chunk host times (seconds) collected by the wrappers of `_instrument`."""

    def __init__(self) -> None:
        self.scheduler: list[float] = []
        self.http: list[float] = []
        self.waiting = 0.0  # engine-chunk wait inside the current body step (event-loop thread only)

    def clear(self) -> None:
        self.scheduler.clear()
        self.http.clear()


@contextmanager
def _instrument(t: _Timings) -> Iterator[None]:
    """Wrap accept_token, the engine's streams and every StreamingResponse body to record `t`; undone on exit."""
    import starlette.responses

    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.engine.scheduler.output_processor import OutputProcessor

    accept, generate = OutputProcessor.accept_token, Engine.async_generate
    response_init = starlette.responses.StreamingResponse.__init__

    def timed_accept(self: Any, *args: Any) -> None:
        t0 = time.thread_time()
        accept(self, *args)
        t.scheduler.append(time.thread_time() - t0)

    async def waited(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        while True:
            t0 = time.thread_time()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            finally:
                t.waiting += time.thread_time() - t0
            yield chunk

    async def timed_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = await generate(self, *args, **kwargs)
        return waited(aiter(out)) if kwargs.get("stream") else out

    async def timed_body(body: AsyncIterator[Any]) -> AsyncIterator[Any]:
        while True:
            t.waiting = 0.0
            t0 = time.thread_time()
            try:
                event = await anext(body)
            except StopAsyncIteration:
                return
            t.http.append(time.thread_time() - t0 - t.waiting)
            yield event

    def init(self: Any, content: Any, *args: Any, **kwargs: Any) -> None:
        response_init(self, timed_body(aiter(content)), *args, **kwargs)

    OutputProcessor.accept_token = timed_accept  # type: ignore[method-assign]
    Engine.async_generate = timed_generate  # type: ignore[method-assign]
    starlette.responses.StreamingResponse.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        OutputProcessor.accept_token = accept  # type: ignore[method-assign]
        Engine.async_generate = generate  # type: ignore[method-assign]
        starlette.responses.StreamingResponse.__init__ = response_init  # type: ignore[method-assign]


_CLIENT = """
import json, sys
import httpx
sizes = []
with httpx.stream("POST", sys.argv[1], json=json.loads(sys.argv[2]), timeout=3600) as r:
    r.raise_for_status()
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            sizes.append(len(line.encode()))
print(json.dumps([len(sizes), sizes[0], sizes[-1]]))
"""


def _stream(url: str, body: dict) -> tuple[int, int, int]:
    """POST a streamed request from a child process (its parsing takes no GIL from the server's threads);
    returns (events, bytes of the first event, bytes of the last data event)."""
    out = subprocess.run([sys.executable, "-c", _CLIENT, url, json.dumps(body)], check=True,
                         capture_output=True, text=True).stdout
    events, first, last = json.loads(out.strip().splitlines()[-1])
    return events, first, last


def _stats(xs: list[float], window: int) -> dict[str, float]:
    first, last = np.array(xs[:window]) * 1e6, np.array(xs[-window:]) * 1e6
    return {"first_median_us": float(np.median(first)), "last_median_us": float(np.median(last)),
            "first_mean_us": float(first.mean()), "last_mean_us": float(last.mean())}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Serve one Engine, stream `--tokens` tokens on each route (after a short warm-up), return the stats."""
    import uvicorn

    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.server.app import create_app

    # Overlap scheduling off: with it, the host work of chunk N runs while step N+1 computes on the same CPU
    # cores, and the CPU time it takes grows with that step (attention over a longer context), not with
    # anything the host does.
    engine = Engine(model_path=args.model_path, context_length=args.tokens + 64, max_running_requests=1,
                    max_total_tokens=args.tokens + 256, chunked_prefill_size=256, disable_radix_cache=True,
                    disable_overlap_schedule=True)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=args.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{args.port}"
    prompt = "Count the stars, one by one:"
    routes = {
        "generate": ("/generate", lambda n: {"text": prompt, "stream": True, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}),
        "completions": ("/v1/completions", lambda n: {"model": "default", "prompt": prompt, "stream": True,
                                                      "temperature": 0.0, "max_tokens": n, "ignore_eos": True}),
    }
    t = _Timings()
    rows = []
    try:
        with _instrument(t):
            for name, (path, body) in routes.items():
                _stream(base + path, body(16))  # compile the programs this stream needs
                t.clear()
                events, first_bytes, last_bytes = _stream(base + path, body(args.tokens))
                # Drop the scheduler's last call (the final reply) and the body's first (the role / first
                # chunk, fetched before the body started) and last step ([DONE]).
                sched, http = t.scheduler[:-1], t.http[1:-1]
                rows.append({"route": name, "tokens": args.tokens, "events": events,
                             "first_event_bytes": first_bytes, "last_event_bytes": last_bytes,
                             "scheduler": _stats(sched, args.window), "http": _stats(http, args.window)})
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens in the measured stream")
    parser.add_argument("--window", type=int, default=100, help="chunks averaged at each end")
    parser.add_argument("--port", type=int, default=30781)
    args = parser.parse_args(argv)
    rows = run(args)
    print(f"server host time per chunk (us), first vs last {args.window} chunks of a {args.tokens}-token "
          "stream, model step excluded")
    print(f"{'route':<12} {'part':<10} {'first med':>10} {'last med':>10} {'first mean':>11} {'last mean':>10}")
    for row in rows:
        for part in ("scheduler", "http"):
            s = row[part]
            print(f"{row['route']:<12} {part:<10} {s['first_median_us']:>10.1f} {s['last_median_us']:>10.1f} "
                  f"{s['first_mean_us']:>11.1f} {s['last_mean_us']:>10.1f}")
        print(f"{row['route']:<12} event bytes: first {row['first_event_bytes']}, last {row['last_event_bytes']}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
