"""`python -m sglang_tpu_qwen.launch_server [flags]`: the HTTP server, with SGLang's flag names.

Builds the Engine, serves `create_app(engine)` with uvicorn on --host/--port, sends one warm-up
request through HTTP (unless --skip-server-warmup, as SGLang's `_execute_server_warmup`), then logs
"The server is fired up and ready to roll!". `/health` answers 503 until then; a warm-up that fails (an
error reply, or a generation that did not finish normally) stops the server, which exits with status 1
and the cause.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import uvicorn

from sglang_tpu_qwen.args.server_args import ServerArgs, prepare_server_args
from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

logger = logging.getLogger("sglang_tpu_qwen.launch_server")

READY_MESSAGE = "The server is fired up and ready to roll!"


class WarmUpError(RuntimeError):
    """The warm-up request did not produce a normal generation; the message says why."""


def _warm_up_request(args: ServerArgs) -> None:
    """POST the warm-up /generate; raise WarmUpError unless it answers 200 with a finished generation."""
    body = {
        "text": "The capital city of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    }
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    req = urllib.request.Request(
        f"http://{host}:{args.port}/generate", data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=1800) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise WarmUpError(f"HTTP {e.code}: {e.read().decode(errors='replace').strip()}") from None
    except Exception as e:
        raise WarmUpError(f"{type(e).__name__}: {e}") from None
    reason = (reply.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") not in ("length", "stop"):
        raise WarmUpError(f"the generation did not finish normally: finish_reason {reason}")


def _warm_up_and_announce(server: uvicorn.Server, args: ServerArgs, engine: Any = None,
                          failures: list[str] | None = None, announce: bool = True) -> None:
    """Wait for uvicorn to listen, POST one short /generate, then mark `engine` warmed up and log the ready line.

    A failed warm-up is logged, appended to `failures` and stops the server: launch_server then exits
    non-zero with the cause (the server would not serve requests either).
    """
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    if not args.skip_server_warmup:
        try:
            _warm_up_request(args)
        except WarmUpError as e:
            logger.error("Warm-up request failed: %s; shutting down.", e)
            if failures is not None:
                failures.append(str(e))
            server.should_exit = True
            return
    if engine is not None:
        engine.set_warmed_up(True)
    if announce:
        logger.info(READY_MESSAGE)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to any interface
        return False


def exposure_warning(args: ServerArgs) -> str | None:
    """The warning to print when the server listens beyond loopback without --api-key (else None)."""
    if args.api_key or is_loopback(args.host):
        return None
    return (f"--host {args.host} serves beyond this machine and no --api-key is set: anyone who can reach the "
            f"port can generate, read /get_server_info and flush the cache. Pass --api-key KEY (or bind 127.0.0.1).")


def launch_server(args: ServerArgs) -> None:
    """Build the Engine and serve it over HTTP until interrupted.

    Raises SystemExit (status 1, the cause as message) when the warm-up request fails.
    """
    warning = exposure_warning(args)
    if warning:
        logger.warning(warning)
    if args.disaggregation_mode == "colocated-split":  # two engines, two ports (disagg/colocated.py)
        from sglang_tpu_qwen.disagg.colocated import launch_colocated_split
        from sglang_tpu_qwen.server.app import create_app

        launch_colocated_split(args, _warm_up_and_announce, create_app)
        return
    if args.disaggregation_transfer_backend == "inprocess":
        raise SystemExit("--disaggregation-transfer-backend inprocess needs --disaggregation-mode colocated-split "
                         "(both engines in one process); use tcp between servers")
    from sglang_tpu_qwen.disagg import roles
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.server.app import create_app

    engine = Engine(args, role=roles.setup)
    failures: list[str] = []
    try:
        engine.set_warmed_up(False)  # /health is 503 until the warm-up request passed
        app = create_app(engine)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_keep_alive=5
        )
        server = uvicorn.Server(config)
        threading.Thread(target=_warm_up_and_announce, args=(server, args, engine, failures), daemon=True).start()
        server.run()
    finally:
        engine.shutdown()
    if failures:
        raise SystemExit(f"Warm-up failed: {failures[0]}")


def size_cpu_thread_pool() -> None:
    """With emulated CPU devices (XLA_FLAGS --xla_force_host_platform_device_count=N), give XLA:CPU a thread
    pool of at least 2N threads (PJRT_NPROC, read when JAX creates its CPU client). Its default is the core
    count; a device program blocked in a collective holds a thread, and with fewer threads than devices the
    other devices' programs cannot reach the collective: the step deadlocks (seen with 8 devices on 2 cores).
    """
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if match and int(match.group(1)) > 1:
        os.environ.setdefault("PJRT_NPROC", str(max(2 * int(match.group(1)), os.cpu_count() or 1)))


def main(argv: list[str] | None = None) -> None:
    """Entry point: parse flags, set up logging, launch."""
    size_cpu_thread_pool()
    on_cpu = run_jax_on_cpu_without_accelerator()
    args = prepare_server_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
    )
    if on_cpu:
        logger.info("No accelerator device found: JAX runs on the CPU (JAX_PLATFORMS=cpu)")
    launch_server(args)


if __name__ == "__main__":
    main()
