"""Processes for the prefill/decode disaggregation tests: real servers, the real `smg` router, over loopback.

`ServerProc.start(...)` runs `python -m sglang_tpu_qwen.launch_server` with the memory-invariant check on
and waits for its ready line; `RouterProc.start(...)` runs `smg launch --pd-disaggregation` and waits until
a request goes through. `assert_idle_and_free(url)` waits for a server to go idle, flushes its prefix cache
and checks every KV page and GDN slot is back in its pool (and no transfer is left over).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from conftest import free_port

READY = "The server is fired up and ready to roll!"
# Small pools and contexts (like conftest.ENGINE_KWARGS) keep compile and run times low on 2 cores.
# No constrained requests in the PD tests: --grammar-backend none skips loading xgrammar (and torch) per server.
SMALL = ["--max-running-requests", "4", "--context-length", "256", "--chunked-prefill-size", "64",
         "--max-prefill-tokens", "512", "--grammar-backend", "none"]


def compile_cache_env() -> dict[str, str]:
    """JAX's persistent compilation cache for the server subprocesses, beside the embedded checkpoint: the
    PD servers compile the same step shapes, so each shape compiles once per machine, not once per server."""
    from sglang_tpu_qwen.embedded.checkpoint import default_cache_root

    return {"JAX_COMPILATION_CACHE_DIR": str(default_cache_root() / "jax_compilation_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def cache_aware_args() -> list[str]:
    """The smg cache-aware settings launch/replicas.sh uses (launch/smg_cache_aware.args, comments dropped)."""
    path = Path(__file__).resolve().parents[1] / "launch" / "smg_cache_aware.args"
    return [w for line in path.read_text().splitlines() for w in line.split("#", 1)[0].split()]


def smg_binary() -> str:
    """The `smg` executable next to this interpreter (installed with the test extra)."""
    path = Path(sys.executable).with_name("smg")
    found = str(path) if path.exists() else shutil.which("smg")
    if not found:
        raise RuntimeError("smg is not installed: pip install -e '.[test]'")
    return found


@dataclass
class ServerProc:
    """A launch_server subprocess: its URL, log file and Popen."""

    url: str
    port: int
    log: Path
    proc: subprocess.Popen

    @classmethod
    def start(cls, log_dir: Path, name: str, args: list[str], env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> ServerProc:
        server = cls.launch(log_dir, name, args, env)
        server.wait_ready(timeout_s)
        return server

    @classmethod
    def launch(cls, log_dir: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> ServerProc:
        """Start the subprocess without waiting for it to be ready (`wait_ready`): servers start side by side."""
        port = free_port()
        log = log_dir / f"{name}.log"
        full_env = dict(os.environ, SGLANG_TPU_QWEN_CHECK_INVARIANTS="1", **compile_cache_env(), **(env or {}))
        cmd = [sys.executable, "-m", "sglang_tpu_qwen.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "info", *args]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        return cls(f"http://127.0.0.1:{port}", port, log, proc)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if READY in self.log.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def info(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/get_server_info", timeout=30)
        r.raise_for_status()
        return r.json()

    def kill(self) -> None:
        """SIGKILL: the process dies as on a crash (no cleanup, sockets reset by the kernel)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class RouterProc:
    """An `smg launch --pd-disaggregation` subprocess."""

    url: str
    log: Path
    proc: subprocess.Popen

    @classmethod
    def start(cls, log_dir: Path, prefill: ServerProc, bootstrap_port: int, decode: ServerProc,
              timeout_s: float = 120.0) -> RouterProc:
        port = free_port()
        log = log_dir / "router.log"
        cmd = [smg_binary(), "launch", "--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port),
               "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
               "--disable-retries", "--shutdown-grace-period-secs", "0",
               # smg's own metrics listener defaults to 0.0.0.0:29000: a second router on the machine would collide.
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        router = cls(f"http://127.0.0.1:{port}", log, proc)
        deadline = time.monotonic() + timeout_s
        body = {"text": "warm", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        while True:  # ready once both workers are registered and a request goes through
            if proc.poll() is not None:
                raise RuntimeError(f"smg exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
            try:
                if httpx.post(router.url + "/generate", json=body, timeout=120).status_code == 200:
                    return router
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg not routing after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def mixed_prompts() -> list[list[int]]:
    """8 prompts of 5-200 tokens; three share a 96-token prefix; five are longer than one prefill chunk (64
    tokens with SMALL), so their KV streams to the decode side in several chunks."""
    rng = np.random.default_rng(7)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1000, 60000, n)]

    shared = ids(96)
    return [ids(5), ids(17), ids(64), ids(65), shared + ids(34), shared + ids(3), shared + ids(60), ids(200)]


def wait_for(predicate: Any, timeout_s: float, what: str, interval: float = 0.2) -> Any:
    """Poll `predicate()` until it returns a truthy value (returned); AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def assert_idle_and_free(server: ServerProc, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until `server` runs, queues and transfers nothing, flush its prefix cache, and check that every
    KV page and GDN slot is free and /health answers 200. Returns the final /get_server_info."""

    def idle() -> dict[str, Any] | None:
        info = server.info()
        pd = info.get("disaggregation", {})
        busy = (info["num_running"] or info["num_waiting"] or pd.get("transfers_waiting", 0)
                or pd.get("outbox_rooms", 0) or pd.get("outbox_fetches_waiting", 0))
        return None if busy else info

    wait_for(idle, timeout_s, f"{server.url} to go idle")
    wait_for(lambda: httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200, 30, "flush_cache")
    info = server.info()
    mem = info["memory"]
    assert mem["kv_pages_free"] == mem["kv_pages_total"], mem
    assert mem["gdn_slots_free"] == mem["gdn_slots_total"], mem
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    return info
