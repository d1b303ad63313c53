"""In-process transfer backend: prefill engines of this process, found by their bootstrap port.

With `--disaggregation-transfer-backend inprocess` (set by `--disaggregation-mode colocated-split`) a
prefill engine registers its role here under its bootstrap port instead of listening on it; a decode
engine of the same process reads that engine's outbox directly and `jax.device_put`s the arrays onto its
own devices: no sockets, no host copy.
"""

from __future__ import annotations

import threading
from typing import Any

from sglang_tpu_qwen.utils.errors import TransferError

_LOCK = threading.Lock()
_PREFILL: dict[int, Any] = {}


def register(port: int, role: Any) -> None:
    """Make a prefill role reachable under `port`; ValueError if another one holds it."""
    with _LOCK:
        if port in _PREFILL and _PREFILL[port] is not role:
            raise ValueError(f"bootstrap port {port} is already used by another prefill engine in this process")
        _PREFILL[port] = role


def unregister(port: int, role: Any) -> None:
    """Remove `role` from `port` (no-op when another or none is registered there)."""
    with _LOCK:
        if _PREFILL.get(port) is role:
            del _PREFILL[port]


def lookup(port: int) -> Any:
    """The prefill role registered under `port`; TransferError (500) when there is none in this process."""
    with _LOCK:
        role = _PREFILL.get(port)
    if role is None:
        raise TransferError(f"no prefill engine with bootstrap port {port} in this process (the inprocess "
                            f"backend only reaches engines of --disaggregation-mode colocated-split)")
    return role
