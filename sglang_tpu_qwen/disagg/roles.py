"""Wiring a disaggregation role into an Engine, and the room of each sequence of a request.

`setup(engine)` builds the role of `--disaggregation-mode` (None for `null`), starts its transport (the
TCP bootstrap server, or the in-process registry entry) and hooks it into the scheduler; the launcher
composes it onto the engine as `Engine(args, role=setup)`. `targets_for(...)` maps a request body's
bootstrap fields onto its sequences (rules in the package docstring); `attach(...)` is what
Engine.async_generate calls with them, through the role's method.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_tpu_qwen.disagg import inprocess
from sglang_tpu_qwen.disagg.bootstrap_server import BootstrapServer
from sglang_tpu_qwen.disagg.decode import DecodeRole
from sglang_tpu_qwen.disagg.layout import StateLayout
from sglang_tpu_qwen.disagg.outbox import Outbox
from sglang_tpu_qwen.disagg.prefill import PrefillRole
from sglang_tpu_qwen.disagg.receiver import InProcessReceiver, Receiver, TcpReceiver
from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)

Target = tuple[str | None, int | None, int | None]  # (bootstrap_host, bootstrap_port, bootstrap_room)


class _Roles:
    """What Engine holds: the role plus its transport, with one shutdown."""

    def __init__(self, role: PrefillRole | DecodeRole, server: BootstrapServer | None, port: int, backend: str,
                 devices: list[int]) -> None:
        self.role = role
        self.server = server
        self.port = port
        self.backend = backend
        self.devices = devices

    def shutdown(self) -> None:
        self.role.shutdown()
        if self.server is not None:
            self.server.shutdown()
        inprocess.unregister(self.port, self.role)

    def attach(self, reqs: list[Request], host: Any, port: Any, room: Any) -> None:
        """See :func:`attach`."""
        attach(self, reqs, host, port, room)

    def reject_call(self, text: Any, input_ids: Any, sampling_params: Any, room: Any, message: str) -> None:
        """See :func:`reject_call`."""
        reject_call(self, text, input_ids, sampling_params, room, message)

    def stats(self) -> dict[str, Any]:
        return {**self.role.stats(), "bootstrap_port": self.port, "transfer_backend": self.backend,
                "devices": self.devices}


def setup(engine: Any) -> _Roles | None:
    """Build and hook the role of engine.server_args.disaggregation_mode; None for `null`.

    Raises OSError when the bootstrap port is taken, ValueError on an unusable combination of flags.
    """
    args = engine.server_args
    mode = args.disaggregation_mode
    if mode == "null":
        return None
    scheduler = engine.scheduler
    layout = StateLayout.from_cache(engine.model_config, engine.runner.cache, engine.runner.backends)
    backend = "inprocess" if args.disaggregation_transfer_backend == "inprocess" else "tcp"
    timeout = args.disaggregation_timeout
    port = args.disaggregation_bootstrap_port
    server = None
    role: PrefillRole | DecodeRole
    if mode == "prefill":
        outbox = Outbox(timeout, stage_to_host=backend == "tcp")
        if backend == "tcp":
            server = BootstrapServer(outbox, args.host, port)
            port = server.port
        role = PrefillRole(scheduler, outbox, layout)
        if backend == "inprocess":
            inprocess.register(port, role)
    elif mode == "decode":
        wake = scheduler.wake

        def make_receiver(host: str, bport: int, room: int, prompt_ids: list[int]) -> Receiver:
            if backend == "inprocess":
                return InProcessReceiver(bport, engine.runner.state.input_placement(), room, layout, prompt_ids,
                                         timeout, wake).start()
            return TcpReceiver(host, bport, room, layout, prompt_ids, timeout, wake).start()

        role = DecodeRole(scheduler, layout, make_receiver)
    else:
        raise ValueError(f"--disaggregation-mode {mode!r} is handled by launch_server, not by one Engine")
    scheduler.set_role(role)
    logger.info("disaggregation: %s role, %s transfers, bootstrap port %d, timeout %g s", mode, backend, port,
                timeout)
    devices = sorted(d.id for d in engine.runner.cache["k"].sharding.device_set)
    return _Roles(role, server, port, backend, devices)


def targets_for(reqs: list[Request], host: Any, port: Any, room: Any) -> list[Target] | None:
    """(host, port, room) of each request (prompt-major, then sample), or None when the body has no room.

    Raises InvalidRequestError when a list's length fits neither the sequences nor the prompts, or a room
    is not an integer.
    """
    if room is None or (isinstance(room, list) and all(x is None for x in room)):
        return None
    k = len(reqs)
    prompt_of: list[int] = []
    sample_of: list[int] = []
    num_prompts = 0
    while len(prompt_of) < k:  # all samples of one prompt share one SamplingParams (n of them)
        n = reqs[len(prompt_of)].params.n
        prompt_of.extend([num_prompts] * n)
        sample_of.extend(range(n))
        num_prompts += 1

    def pick(value: Any, i: int, name: str, add_sample: bool) -> Any:
        if not isinstance(value, list):
            return value + i if add_sample and _is_int(value) else value
        if len(value) == k:
            return value[i]
        if len(value) == num_prompts:
            v = value[prompt_of[i]]
            return v + sample_of[i] if add_sample and _is_int(v) else v
        raise InvalidRequestError(f"{name} has {len(value)} entries for {num_prompts} prompt(s) and {k} "
                                  f"sequence(s)")

    out = []
    for i in range(k):
        r_room = pick(room, i, "bootstrap_room", True)
        if r_room is not None and not _is_int(r_room):
            raise InvalidRequestError(f"bootstrap_room must be an integer, got {r_room!r}")
        out.append((pick(host, i, "bootstrap_host", False), pick(port, i, "bootstrap_port", False), r_room))
    return out


def attach(roles: _Roles, reqs: list[Request], host: Any, port: Any, room: Any) -> None:
    """Turn the requests of one call into transfer legs of this server's role (no-op without a room).

    Raises InvalidRequestError for malformed bootstrap fields or a room already in use.
    """
    targets = targets_for(reqs, host, port, room)
    if targets is None:
        return
    try:
        roles.role.attach(reqs, targets)
    except TransferError as e:
        raise InvalidRequestError(e.message) from e


def reject_call(roles: _Roles, text: Any, input_ids: Any, sampling_params: Any, room: Any,
                message: str) -> None:
    """A call refused before it became Requests (bad input): on a prefill server, post a 400 with `message`
    to every room the call's sequences would have used, so the decode legs waiting on them fail too.
    """
    if room is None:
        return
    if isinstance(text, list):
        num_prompts = len(text)
    elif isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        num_prompts = len(input_ids)
    else:
        num_prompts = 1
    sp = sampling_params[0] if isinstance(sampling_params, list) and sampling_params else sampling_params
    samples = sp.get("n", 1) if isinstance(sp, dict) else 1
    samples = samples if _is_int(samples) and samples >= 1 else 1
    k = num_prompts * samples
    if not isinstance(room, list):
        rooms = [room + i for i in range(k)] if _is_int(room) else []
    elif len(room) == k:
        rooms = list(room)
    else:
        rooms = [base + j for base in room if _is_int(base) for j in range(samples)]
    roles.role.reject([(None, None, r) for r in rooms if _is_int(r)], 400, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
