"""Compilation bookkeeping: the persistent compilation cache and the process-wide compilation counter.

Every XLA program JAX builds goes through `compile_or_get_cached`, which reports a
`/jax/core/compile/backend_compile_duration` event (also when the executable comes from the persistent
cache, which additionally reports `/jax/compilation_cache/cache_hits`). A `jax.monitoring` listener
counts both; `sglang:jit_compilations` on /metrics and `jit_compilations` in /get_server_info read them.
Once an engine has precompiled its buckets (`arm`), any further compilation is logged as an error: a
request reached a shape outside the compiled set. While an engine of the process starts (`precompiling`:
Engine loads, builds and precompiles inside it; colocated-split starts its decode engine after the prefill
engine is armed), compilations are that start's and are not logged as errors; the counter still counts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class _Counter:
    """Process-wide counts of backend compilations (persistent-cache loads included) and cache hits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compilations = 0
        self.cache_hits = 0
        self.armed = 0  # engines that finished precompiling and are serving
        self.precompiling = 0  # engines precompiling now
        self._installed = False

    def install(self) -> None:
        with self._lock:
            if self._installed:
                return
            self._installed = True
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration_s: float, **kwargs: object) -> None:
        if event != _BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.compilations += 1
            unexpected = self.armed and not self.precompiling
        if unexpected:
            logger.error("compiled %s (%.2f s) after the server was ready: a step fell outside the precompiled "
                         "buckets (engine/runner/buckets.py)", kwargs.get("fun_name", "?"), duration_s)

    def _on_event(self, event: str, **kwargs: object) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1


COUNTER = _Counter()


def install_counter() -> None:
    """Register the jax.monitoring listeners (idempotent)."""
    COUNTER.install()


def jit_compilations() -> int:
    """Backend compilations in this process so far (including programs loaded from the persistent cache)."""
    return COUNTER.compilations


def cache_hits() -> int:
    """Programs loaded from the persistent compilation cache in this process so far."""
    return COUNTER.cache_hits


def arm() -> None:
    """An engine finished precompiling: from now on a compilation is an error (logged)."""
    with COUNTER._lock:
        COUNTER.armed += 1


@contextlib.contextmanager
def precompiling() -> Iterator[None]:
    """Around an engine's start (load, build, precompile): the compilations meanwhile are expected, even with
    another engine of the process armed."""
    with COUNTER._lock:
        COUNTER.precompiling += 1
    try:
        yield
    finally:
        with COUNTER._lock:
            COUNTER.precompiling -= 1


def disarm() -> None:
    """An armed engine shut down."""
    with COUNTER._lock:
        COUNTER.armed = max(0, COUNTER.armed - 1)


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/sglang_tpu_qwen/jax_cache (default ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "sglang_tpu_qwen" / "jax_cache")


def configure_persistent_cache(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `path` (created if missing) and cache every program.

    `path` None means JAX's own setting (JAX_COMPILATION_CACHE_DIR) if any, else default_cache_dir(); "" or
    "none" disables the persistent cache. Every program is
    written (min compile time 0 s, no minimum size), so a restart with the same flags compiles nothing.
    Returns the directory in use, or None when disabled.
    """
    from jax._src import compilation_cache as cc  # reset when another engine of this process chose another dir

    if path is not None and path.strip().lower() in ("", "none"):
        if jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", None)
            cc.reset_cache()
        return None
    path = str(Path(path or jax.config.jax_compilation_cache_dir or default_cache_dir()).expanduser())
    Path(path).mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        cc.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """Compile past JAX's persistent cache within the block, then restore the directory in use: deviceless
    executables (the planner's, compiled for a TPU topology in a process whose engine turned the cache on) cannot
    be loaded back from it (no client to load them into), and a later process would warn "Error reading
    persistent compilation cache entry" and compile again."""
    previous = jax.config.jax_compilation_cache_dir
    configure_persistent_cache("none")
    try:
        yield
    finally:
        if previous:
            configure_persistent_cache(previous)
