"""`--disaggregation-mode colocated-split`: a prefill engine and a decode engine in one process.

The devices are split in two groups: the first `--disaggregation-prefill-devices` (default half) serve a
prefill engine on `--port`, the rest a decode engine on `--disaggregation-decode-port` (default port + 1).
Each engine places its weights and cache on its own group (its mesh there with --dp-size/--ep-size, else
its first device), and each has its own HTTP server, so a PD router sees two workers:

    smg launch --pd-disaggregation --prefill http://HOST:PORT BOOTSTRAP_PORT --decode http://HOST:PORT+1

Transfers use the in-process backend (inprocess.py): the decode engine reads the prefill engine's outbox and
`jax.device_put`s the arrays onto its devices.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from sglang_tpu_qwen.args.server_args import ServerArgs

logger = logging.getLogger(__name__)


def split_args(args: ServerArgs) -> tuple[ServerArgs, ServerArgs]:
    """Per-engine ServerArgs: (prefill on --port, decode on --disaggregation-decode-port or port + 1)."""
    backend = "inprocess" if args.disaggregation_transfer_backend == "auto" else args.disaggregation_transfer_backend
    common = dict(disaggregation_transfer_backend=backend)
    prefill = dataclasses.replace(args, disaggregation_mode="prefill", **common)
    decode_port = args.disaggregation_decode_port or args.port + 1
    decode = dataclasses.replace(args, disaggregation_mode="decode", port=decode_port, **common)
    return prefill, decode


def device_groups(num_prefill: int | None, devices: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
    """Split the devices (default `jax.devices()`) into (prefill group, decode group).

    Raises ValueError when a group would be empty.
    """
    devs = list(jax.devices() if devices is None else devices)
    k = len(devs) // 2 if num_prefill is None else num_prefill
    if not 0 < k < len(devs):
        raise ValueError(f"colocated-split needs devices for both engines: {len(devs)} device(s), {k} for prefill "
                         f"(set --disaggregation-prefill-devices; on CPU emulate more devices with XLA_FLAGS="
                         f"--xla_force_host_platform_device_count=N)")
    return devs[:k], devs[k:]


def launch_colocated_split(args: ServerArgs, warm_up_and_announce: Callable[..., None],
                           create_app: Callable[[Any], Any]) -> None:
    """Build both engines, serve both over HTTP until interrupted (KeyboardInterrupt stops both).

    The launcher composes the HTTP side and passes it in, so disagg/ imports neither its caller nor
    server/ (the two folders share a layer): warm_up_and_announce(server, args, announce=True) is
    launch_server's warm-up; create_app(engine) -> ASGI app is server.app.create_app.
    """
    import uvicorn

    from sglang_tpu_qwen.disagg import roles
    from sglang_tpu_qwen.engine.engine import Engine

    prefill_args, decode_args = split_args(args)
    prefill_devs, decode_devs = device_groups(args.disaggregation_prefill_devices)
    logger.info("colocated-split: prefill on %s (port %d), decode on %s (port %d)", prefill_devs,
                prefill_args.port, decode_devs, decode_args.port)
    engines = []
    try:
        engines.append(Engine(prefill_args, devices=prefill_devs, role=roles.setup))
        engines.append(Engine(decode_args, devices=decode_devs, role=roles.setup))
        servers = []
        for engine, eargs in zip(engines, (prefill_args, decode_args), strict=True):
            config = uvicorn.Config(create_app(engine), host=eargs.host, port=eargs.port,
                                    log_level=eargs.log_level.lower(), timeout_keep_alive=5)
            server = uvicorn.Server(config)
            threading.Thread(target=server.run, name=f"http-{eargs.port}", daemon=True).start()
            servers.append(server)

        def warm_up() -> None:
            warm_up_and_announce(servers[0], prefill_args, announce=False)
            warm_up_and_announce(servers[1], decode_args)

        threading.Thread(target=warm_up, daemon=True).start()
        try:
            while not any(s.should_exit for s in servers):
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        for s in servers:
            s.should_exit = True
        time.sleep(0.5)
    finally:
        for engine in engines:
            engine.shutdown()
