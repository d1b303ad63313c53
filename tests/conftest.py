"""Shared fixtures: one real Engine (embedded model, small limits) served over real HTTP.

`engine` builds the Engine once per test session; `server` serves it with uvicorn in a thread on a
free 127.0.0.1 port and yields a `LiveServer` (base `url`, the `engine`). `serve_app(app)` is the
helper both use; other tests may call it to serve another app (e.g. with an api key) over the same
engine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

# Small limits keep the suite fast on 2 CPU cores; enable_metrics so /metrics can be checked. Programs compile
# on first use (disable_precompile): the session engine needs few of them; test_compile.py checks precompile.
# Compact JSON for json_schema constraints: the random-weight model prefers whitespace tokens and would pad JSON
# forever.
ENGINE_KWARGS: dict[str, Any] = dict(max_running_requests=4, context_length=256, enable_metrics=True,
                                     chunked_prefill_size=256, max_prefill_tokens=512,
                                     constrained_json_disable_any_whitespace=True, disable_precompile=True)


@dataclass
class LiveServer:
    """A running HTTP server: its base URL and the engine behind it."""

    url: str
    engine: Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(app: Any, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve a FastAPI app with uvicorn in a daemon thread; yields its base URL, stops it on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    """The real Engine with the embedded model (see ENGINE_KWARGS)."""
    from sglang_tpu_qwen.engine.engine import Engine

    eng = Engine(**ENGINE_KWARGS)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    """`create_app(engine)` served over HTTP for the whole session."""
    from sglang_tpu_qwen.server.app import create_app

    with serve_app(create_app(engine)) as url:
        yield LiveServer(url=url, engine=engine)


# Measured figures tests record (errors vs tolerance, compiled memory); shown at the end of every run,
# so CI's log carries them even though pytest captures the output of passing tests.
SUMMARY: dict[str, list[str]] = {}


def record(section: str, line: str) -> None:
    """Print `line` and keep it for the end-of-run summary under `section`."""
    print(line)
    SUMMARY.setdefault(section, []).append(line)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for section, lines in SUMMARY.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
