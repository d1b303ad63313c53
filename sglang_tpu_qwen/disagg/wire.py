"""Messages of a transfer and their TCP framing.

A transfer is a sequence of messages, each a JSON dict plus zero or more arrays:

    {"kind": "header", "version", "layout", "num_tokens", "prompt_digest", "source_page_size", "rid"}
    {"kind": "kv", "start", "end"}                 arrays k, v  [n_attn, end - start, kv_heads, head_dim]
    {"kind": "gdn"}                                arrays conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv]
    {"kind": "done", "first_token", "logprob", "top_logprobs", "top_ids", "cached_tokens", "draft_tokens"}
    {"kind": "error", "status", "message"}        (instead of the rest, at any point)
    {"kind": "wait"}                               keepalive while the prefill is queued or running

KV chunks cover [0, num_tokens) in order without gaps; `done` ends a successful transfer. The decode
side opens a connection with {"op": "fetch", "room", "version"} (or {"op": "cancel", "room"}).

On TCP each message is a frame: magic b"SGQD", uint32 JSON length, uint64 payload length (network
order), the JSON, then the arrays' raw C-order bytes back to back; the JSON's "arrays" entry lists
[dtype name, shape] per array so the reader slices the payload without guessing.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from sglang_tpu_qwen.utils.errors import TransferError

MAGIC = b"SGQD"
_HEAD = struct.Struct("!4sIQ")
MAX_JSON_BYTES = 1 << 20


@dataclass
class Message:
    """One transfer message: `meta` (JSON-able dict with "kind") and its arrays (numpy, or jax in process)."""

    meta: dict[str, Any]
    arrays: list[Any] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


def send_message(sock: socket.socket, msg: Message) -> None:
    """Write one frame; arrays are converted to host numpy (a device array is fetched here)."""
    host = [np.ascontiguousarray(np.asarray(a)) for a in msg.arrays]
    meta = dict(msg.meta, arrays=[[a.dtype.name, list(a.shape)] for a in host])
    blob = json.dumps(meta).encode()
    payload = sum(a.nbytes for a in host)
    sock.sendall(_HEAD.pack(MAGIC, len(blob), payload) + blob)
    for a in host:
        if a.nbytes:
            sock.sendall(memoryview(a.reshape(-1).view(np.uint8)))  # raw bytes (bfloat16 has no buffer format)


def dtype_of(name: str) -> np.dtype:
    """numpy dtype from its name, including ml_dtypes' (bfloat16, float8_*); TransferError if unknown."""
    try:
        return np.dtype(name)
    except TypeError:
        if hasattr(ml_dtypes, name):
            return np.dtype(getattr(ml_dtypes, name))
        raise TransferError(f"unknown dtype {name!r} in a transfer frame") from None


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


def recv_message(sock: socket.socket) -> Message:
    """Read one frame. Raises ConnectionError on EOF, TransferError on a malformed frame."""
    magic, json_len, payload_len = _HEAD.unpack(bytes(_recv_exact(sock, _HEAD.size)))
    if magic != MAGIC:
        raise TransferError(f"not a transfer frame (magic {magic!r}): is the bootstrap port another service?")
    if json_len > MAX_JSON_BYTES:
        raise TransferError(f"transfer frame header too large ({json_len} bytes)")
    meta = json.loads(bytes(_recv_exact(sock, json_len)))
    specs = meta.pop("arrays", [])
    dtypes = [dtype_of(dt) for dt, _ in specs]
    sizes = [d.itemsize * int(np.prod(shape, dtype=np.int64)) for d, (_, shape) in zip(dtypes, specs, strict=True)]
    if sum(sizes) != payload_len:
        raise TransferError(f"transfer frame payload is {payload_len} bytes, its arrays need {sum(sizes)}")
    payload = _recv_exact(sock, payload_len) if payload_len else bytearray()
    arrays, off = [], 0
    for dt, (_, shape), size in zip(dtypes, specs, sizes, strict=True):
        arrays.append(np.frombuffer(payload, dtype=dt, count=size // dt.itemsize, offset=off).reshape(shape))
        off += size
    return Message(meta, arrays)


def send_request(sock: socket.socket, request: dict[str, Any]) -> None:
    """Write a decode -> prefill request (a frame without arrays)."""
    send_message(sock, Message(request))
