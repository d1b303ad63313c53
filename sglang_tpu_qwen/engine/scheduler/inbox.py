"""The scheduler's inbox: messages other threads send to the scheduler thread, and its wake-up event.

Each message is a small dataclass; one that wants an answer carries a `concurrent.futures.Future` the
scheduler thread resolves.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from sglang_tpu_qwen.engine.io.request import Request


@dataclass
class AddRequests:
    """New requests (already validated) for the waiting queue."""

    reqs: list[Request]


@dataclass
class AbortRequest:
    """Abort `rid` and all its samples (`rid::j`); None aborts every request."""

    rid: str | None


@dataclass
class FlushCache:
    """Empty the prefix cache if nothing is waiting or running; `done` gets True when it was flushed."""

    done: Future[bool] = field(default_factory=Future)


Message = AddRequests | AbortRequest | FlushCache


class Inbox:
    """A thread-safe queue of Messages plus the event that wakes the scheduler loop."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wakeup = threading.Event()

    def put(self, msg: Message) -> None:
        self._queue.put(msg)
        self._wakeup.set()

    def wake(self) -> None:
        """Wake the loop without a message (a role's transfer changed state, shutdown)."""
        self._wakeup.set()

    def wait(self, timeout: float) -> None:
        """Sleep until a put / wake or `timeout` seconds, then clear the event."""
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def qsize(self) -> int:
        """Messages queued and not drained yet (approximate while other threads put)."""
        return self._queue.qsize()

    def drain(self) -> Iterator[Message]:
        """The messages queued now, oldest first."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
