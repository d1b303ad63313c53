"""Outbox: the prefill server's transfers, one room each, from the scheduler to whoever fetches them.

The scheduler thread (producer) opens a room when a prefill request arrives, appends KV chunks as its
prefill chunks complete, then the GDN state and `done` (or `error`). A fetcher (the TCP bootstrap server's
connection thread, or the decode engine's receiver in process) iterates the room's messages as they
come, possibly before the prefill has finished: that is the streaming. A room is dropped when its last
message has been fetched, when the decode side cancels it, or when it sat `timeout_s` seconds with
nobody fetching and nothing produced; its arrays (host or device copies) go with it. Device memory of the
request (pages, slot) is never held here: the scheduler frees it as soon as the state is copied out.

With `stage_to_host` (TCP) a background thread copies each message's device arrays to host numpy right
after they are put, so device copies live only briefly and the scheduler thread never waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import numpy as np

from sglang_tpu_qwen.disagg.wire import Message
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # a fetch waiting for the next message sends {"kind": "wait"} this often


@dataclass
class _Room:
    room: int
    rid: str | None
    messages: list[Message] = field(default_factory=list)
    closed: bool = False  # its last message (done / error) is in
    fetching: bool = False
    last_activity: float = 0.0  # the outbox clock's seconds of the last put or fetch (set on creation)


class Outbox:
    """Rooms of one prefill server. Thread-safe; see the module docstring for the life of a room.

    `timeout_s` is measured on `clock` (seconds, default time.monotonic): the idle time after which an
    unfetched room is dropped, a fetch stops waiting for its room to open, and a cancel of a room not yet
    opened is forgotten. Tests pass a manual clock so a timeout passes because they say so; waits still
    wake at least every 0.5 s of real time to read it.
    """

    def __init__(self, timeout_s: float, stage_to_host: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._rooms: dict[int, _Room] = {}
        self._cancelled: dict[int, float] = {}  # room -> expiry: cancels that arrived before the room opened
        self._new_cancels: set[int] = set()
        self._fetches_waiting = 0  # fetches whose room has not opened yet
        self._cond = threading.Condition()
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="outbox-stage") if stage_to_host else None
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_loop, name="outbox-reaper", daemon=True)
        self._reaper.start()

    # ---- producer (the prefill scheduler) ------------------------------------------------------
    def open(self, room: int, header: Message, rid: str | None = None) -> bool:
        """Start a room with its header. False (nothing opened) when the decode side already cancelled it;
        raises TransferError if the room is already in use (two requests with one room)."""
        with self._cond:
            if self._cancelled.pop(room, None) is not None:
                return False
            if room in self._rooms:
                raise TransferError(f"bootstrap_room {room} is already in use on this prefill server", 400)
            self._rooms[room] = _Room(room, rid, [header], last_activity=self._clock())
            self._cond.notify_all()
        return True

    def put(self, room: int, msg: Message) -> bool:
        """Append a message; `done`/`error` close the room. False when the room is gone (cancelled or timed
        out): the caller should stop working for it."""
        with self._cond:
            r = self._rooms.get(room)
            if r is None or r.closed:
                return False
            r.messages.append(msg)
            r.closed = msg.kind in ("done", "error")
            r.last_activity = self._clock()
            self._cond.notify_all()
        if self._stager is not None and msg.arrays:
            self._stager.submit(_stage, msg)
        return True

    def fail(self, room: int, status: int, message: str) -> None:
        """Close a room with an error (opening it if needed: a request rejected before it was built)."""
        with self._cond:
            if room not in self._rooms:
                if self._cancelled.pop(room, None) is not None:
                    return
                self._rooms[room] = _Room(room, None, last_activity=self._clock())
        self.put(room, Message({"kind": "error", "status": status, "message": message}))

    def take_cancelled(self) -> set[int]:
        """Rooms the decode side cancelled since the last call (their prefill should be aborted)."""
        with self._cond:
            out, self._new_cancels = self._new_cancels, set()
        return out

    # ---- consumer (a fetch) --------------------------------------------------------------------
    def fetch(self, room: int, stop: threading.Event | None = None) -> Iterator[Message]:
        """Yield the room's messages in order as they are produced, ending after `done` / `error`.

        Waits up to timeout_s for the room to open. Once it is open the prefill request behind it is alive
        (queued or running), so the wait for its next message is unbounded, with a `{"kind": "wait"}`
        keepalive every KEEPALIVE_S: the decode side's own timeout then only fires on a silent (hung or
        unreachable) prefill server, not on a busy one. Raises TransferError when the room does not open in
        time, is cancelled (before or after it opened) or timed out meanwhile, or another fetch already holds
        it; `stop` set ends the iteration quietly. Closing the iterator early cancels the room.
        """
        index = 0
        finished = attached = waiting = False
        open_deadline = self._clock() + self.timeout_s
        try:
            while True:
                with self._cond:
                    keepalive_at = self._clock() + KEEPALIVE_S
                    while True:
                        r = self._rooms.get(room)
                        if waiting != (r is None and not attached):
                            waiting = not waiting
                            self._fetches_waiting += 1 if waiting else -1
                        if r is not None and not attached:
                            if r.fetching:
                                finished = True  # not ours to cancel
                                raise TransferError(f"bootstrap_room {room} is already being fetched")
                            r.fetching = attached = True
                        if r is not None and index < len(r.messages):
                            msg = r.messages[index]
                            r.last_activity = self._clock()
                            break
                        if r is None and attached:
                            raise TransferError(f"bootstrap_room {room} was cancelled on the prefill server")
                        if r is None and room in self._cancelled:
                            finished = True  # cancelled already: nothing to cancel again
                            raise TransferError(f"bootstrap_room {room} was cancelled by the decode side")
                        if stop is not None and stop.is_set() or self._closed:
                            return
                        now = self._clock()
                        if r is None and now > open_deadline:
                            raise TransferError(f"timed out after {self.timeout_s:g} s waiting for the prefill "
                                                f"server to receive bootstrap_room {room}")
                        if now >= keepalive_at:
                            msg = Message({"kind": "wait"})
                            break
                        self._cond.wait(min(keepalive_at - now, 0.5))
                if msg.kind != "wait":
                    index += 1
                if msg.kind in ("done", "error"):
                    finished = True
                    self._drop(room)
                yield msg
                if finished:
                    return
        finally:
            if waiting:
                with self._cond:
                    self._fetches_waiting -= 1
            if not finished:
                self.cancel(room)

    def cancel(self, room: int) -> None:
        """The decode side gave up on the room: drop it (or remember the cancel until it opens)."""
        with self._cond:
            if self._rooms.pop(room, None) is None:
                self._cancelled[room] = self._clock() + self.timeout_s
            self._new_cancels.add(room)
            self._cond.notify_all()

    # ---- housekeeping --------------------------------------------------------------------------
    def _drop(self, room: int) -> None:
        with self._cond:
            self._rooms.pop(room, None)
            self._cond.notify_all()

    def reap(self) -> list[int]:
        """Drop rooms idle for timeout_s with no fetch attached; returns their ids."""
        now = self._clock()
        with self._cond:
            stale = [k for k, r in self._rooms.items() if not r.fetching and now - r.last_activity > self.timeout_s]
            for k in stale:
                del self._rooms[k]
            self._new_cancels.update(stale)
            for k in [k for k, exp in self._cancelled.items() if exp < now]:
                del self._cancelled[k]
        for k in stale:
            logger.warning("dropped the state of bootstrap_room %d: nobody fetched it within %g s", k, self.timeout_s)
        return stale

    def _reap_loop(self) -> None:
        while not self._closed:
            time.sleep(min(1.0, max(self.timeout_s / 4, 0.05)))
            self.reap()

    def stats(self) -> dict[str, int]:
        """Rooms held, the bytes of their arrays (host or device copies), cancels of rooms not opened yet, and
        fetches (decode-side receivers) waiting for their room to open."""
        with self._cond:
            rooms = list(self._rooms.values())
            early_cancels, fetches_waiting = len(self._cancelled), self._fetches_waiting
        return {"outbox_rooms": len(rooms), "outbox_bytes": sum(m.nbytes for r in rooms for m in r.messages),
                "outbox_early_cancels": early_cancels, "outbox_fetches_waiting": fetches_waiting}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._rooms.clear()
            self._cond.notify_all()
        if self._stager is not None:
            self._stager.shutdown(wait=False, cancel_futures=True)


def _stage(msg: Message) -> None:
    """Replace a message's device arrays by host copies (in the stager thread)."""
    try:
        msg.arrays = [np.asarray(a) for a in jax.device_get(msg.arrays)]
    except Exception:  # the fetch thread converts on send anyway; staging is only an optimisation
        logger.exception("staging a transfer message to host memory failed")
