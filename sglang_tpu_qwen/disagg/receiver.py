"""Decode side of a transfer: a background thread per room collects the state the prefill server sends.

`Receiver` checks the header against this server (protocol version, state layout, token count, prompt
hash), gathers the KV chunks in order, the GDN state and the first token, and ends `ready` with a
`ReceivedState`, or `failed` with a TransferError (the prefill's own rejection, a mismatch, a lost peer, a
timeout). The scheduler polls `status`; `cancel()` stops it and tells the prefill server to drop the room.
Two transports: `TcpReceiver` (the prefill's bootstrap server) and `InProcessReceiver` (an Outbox in this
process, arrays moved with `jax.device_put`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.disagg.layout import PROTOCOL_VERSION, StateLayout, prompt_digest
from sglang_tpu_qwen.disagg.outbox import Outbox
from sglang_tpu_qwen.disagg.wire import Message, recv_message, send_request
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)

# A refused connection is retried this long: the bootstrap server listens before the prefill server's HTTP
# port opens, so a longer refusal means the prefill server is not there.
CONNECT_GRACE_S = 5.0


@dataclass
class ReceivedState:
    """A request's state as received: KV `[n_attn, T, kv_heads, head_dim]` (k, v), GDN conv / rec, first token.

    Arrays are host numpy (TCP) or device arrays on this server's devices (in process). `first_token` is
    None when the request asked for no new token (max_new_tokens 0).
    """

    num_tokens: int
    k: Any
    v: Any
    conv: Any
    rec: Any
    first_token: int | None
    logprob: float | None
    top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    top_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    cached_tokens: int = 0
    nbytes: int = 0
    draft_tokens: list[int] = field(default_factory=list)  # the prefill server's MTP drafts (speculative decoding)


class Receiver:
    """Collects one room in a daemon thread; see the module docstring. Subclasses supply the transport."""

    def __init__(self, room: int, layout: StateLayout, prompt_ids: list[int], timeout_s: float,
                 on_change: Callable[[], None]) -> None:
        self.room = room
        self.layout = layout
        self.prompt_ids = prompt_ids
        self.timeout_s = timeout_s
        self._on_change = on_change
        self.status = "waiting"  # -> "ready" | "failed"
        self.state: ReceivedState | None = None
        self.error: TransferError | None = None
        self.received_bytes = 0
        self.started = time.monotonic()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pd-recv-{room}", daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop waiting; the prefill server is told to drop the room (from the receiver thread)."""
        self._cancelled.set()
        self._interrupt()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # ---- transport hooks -----------------------------------------------------------------------
    def _messages(self) -> Iterator[Message]:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Unblock `_messages` from another thread."""

    def _cancel_remote(self) -> None:
        """Tell the prefill server to drop the room."""

    def _place(self, arrays: list[Any]) -> list[Any]:
        return arrays

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.state = self._collect()
            if self.state is not None:
                self.status = "ready"
        except TransferError as e:
            self._fail(e)
        except (OSError, ConnectionError) as e:
            if not self.cancelled:
                self._fail(TransferError(f"lost the prefill server while waiting for bootstrap_room {self.room}: "
                                         f"{e}", 500))
        except Exception as e:  # a bug here must fail the request, not leave it waiting forever
            logger.exception("receiving bootstrap_room %d failed", self.room)
            self._fail(TransferError(f"receiving the prefill state failed: {e!r}", 500))
        finally:
            if self.cancelled:
                try:
                    self._cancel_remote()
                except Exception:  # best effort: the prefill side also times the room out
                    logger.debug("cancel of room %d not delivered", self.room, exc_info=True)
            self._on_change()

    def _fail(self, e: TransferError) -> None:
        self.error = e
        self.status = "failed"

    def _collect(self) -> ReceivedState | None:
        header: dict[str, Any] | None = None
        ks: list[Any] = []
        vs: list[Any] = []
        gdn: list[Any] | None = None
        upto = 0
        for msg in self._messages():
            if self.cancelled:
                return None
            meta = msg.meta
            kind = msg.kind
            if kind == "wait":  # keepalive: the prefill server is alive, the request queued or running
                continue
            self.received_bytes += msg.nbytes
            if kind == "error":
                raise TransferError(str(meta.get("message", "the prefill server failed the request")),
                                    int(meta.get("status", 500)))
            if kind == "header":
                header = meta
                self._check_header(meta)
            elif header is None:
                raise TransferError(f"transfer of bootstrap_room {self.room} did not start with a header")
            elif kind == "kv":
                start, end = int(meta["start"]), int(meta["end"])
                if start != upto or end <= start or end > len(self.prompt_ids):
                    raise TransferError(f"KV chunk [{start}, {end}) out of order (have {upto} tokens)")
                k, v = self._place(msg.arrays)
                expect = (self.layout.kv_token_shape[0], end - start, *self.layout.kv_token_shape[1:])
                if tuple(k.shape) != expect or tuple(v.shape) != expect:
                    raise TransferError(f"KV chunk shape {tuple(k.shape)} is not {expect}")
                ks.append(k)
                vs.append(v)
                upto = end
            elif kind == "gdn":
                gdn = self._place(msg.arrays)
                if (tuple(gdn[0].shape), tuple(gdn[1].shape)) != (self.layout.conv_shape, self.layout.rec_shape):
                    raise TransferError(f"GDN state shapes {gdn[0].shape}, {gdn[1].shape} are not "
                                        f"{self.layout.conv_shape}, {self.layout.rec_shape}")
            elif kind == "done":
                n = len(self.prompt_ids)
                if upto != n or gdn is None:
                    raise TransferError(f"transfer of bootstrap_room {self.room} ended early ({upto} of {n} "
                                        f"tokens{', no GDN state' if gdn is None else ''})")
                cat = np.concatenate if isinstance(ks[0], np.ndarray) else jnp.concatenate
                first = meta.get("first_token")
                return ReceivedState(
                    num_tokens=n, k=cat(ks, axis=1) if len(ks) > 1 else ks[0],
                    v=cat(vs, axis=1) if len(vs) > 1 else vs[0], conv=gdn[0], rec=gdn[1],
                    first_token=None if first is None else int(first),
                    logprob=None if meta.get("logprob") is None else float(meta["logprob"]),
                    top_logprobs=np.asarray(meta.get("top_logprobs") or [], np.float32),
                    top_ids=np.asarray(meta.get("top_ids") or [], np.int32),
                    cached_tokens=int(meta.get("cached_tokens", 0)), nbytes=self.received_bytes,
                    draft_tokens=[int(t) for t in meta.get("draft_tokens") or []])
            else:
                raise TransferError(f"unknown transfer message kind {kind!r}")
        if self.cancelled:
            return None
        raise TransferError(f"the prefill server closed bootstrap_room {self.room} before the state was complete")

    def _check_header(self, meta: dict[str, Any]) -> None:
        if meta.get("version") != PROTOCOL_VERSION:
            raise TransferError(f"transfer protocol version {meta.get('version')} is not {PROTOCOL_VERSION}")
        self.layout.check_matches(StateLayout.from_json(meta.get("layout") or {}))
        n = int(meta.get("num_tokens", -1))
        if n != len(self.prompt_ids) or meta.get("prompt_digest") != prompt_digest(self.prompt_ids):
            raise TransferError(f"the prefill server's prompt ({n} tokens) is not this request's "
                                f"({len(self.prompt_ids)} tokens): both legs must get the same request body", 400)


class TcpReceiver(Receiver):
    """Fetches a room from the prefill server's bootstrap server (bootstrap_server.py) over TCP."""

    def __init__(self, host: str, port: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host, self.port = host, port
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + min(CONNECT_GRACE_S, self.timeout_s)
        while True:
            try:
                return socket.create_connection((self.host, self.port), timeout=min(self.timeout_s, 30.0))
            except ConnectionRefusedError as e:
                if time.monotonic() > deadline or self.cancelled:
                    raise TransferError(f"no prefill bootstrap server at {self.host}:{self.port} ({e})", 500) from e
                time.sleep(0.1)
            except OSError as e:
                raise TransferError(f"cannot reach the prefill bootstrap server {self.host}:{self.port}: {e}",
                                    500) from e

    def _messages(self) -> Iterator[Message]:
        sock = self._connect()
        with self._lock:
            self._sock = sock
        if self.cancelled:
            sock.close()
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_request(sock, {"op": "fetch", "room": self.room, "version": PROTOCOL_VERSION})
            sock.settimeout(self.timeout_s)  # longest silence between two messages
            while True:
                try:
                    msg = recv_message(sock)
                except TimeoutError as e:
                    raise TransferError(f"timed out after {self.timeout_s:g} s waiting for the prefill of "
                                        f"bootstrap_room {self.room}", 500) from e
                except OSError:
                    if self.cancelled:
                        return
                    raise
                yield msg
                if msg.kind in ("done", "error"):
                    return
        finally:
            sock.close()

    def _interrupt(self) -> None:
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _cancel_remote(self) -> None:
        with socket.create_connection((self.host, self.port), timeout=5.0) as s:
            send_request(s, {"op": "cancel", "room": self.room})


class InProcessReceiver(Receiver):
    """Fetches a room from the prefill engine registered under `port` in this process (inprocess.py); arrays
    are `jax.device_put` to `placement` (this decode engine's devices)."""

    def __init__(self, port: int, placement: jax.sharding.Sharding, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.port = port
        self.placement = placement
        self.outbox: Outbox | None = None

    def _messages(self) -> Iterator[Message]:
        from sglang_tpu_qwen.disagg import inprocess

        self.outbox = inprocess.lookup(self.port).outbox
        return self.outbox.fetch(self.room, self._cancelled)

    def _place(self, arrays: list[Any]) -> list[Any]:
        return [jax.device_put(a, self.placement) for a in arrays]

    def _cancel_remote(self) -> None:
        if self.outbox is not None:
            self.outbox.cancel(self.room)
