"""How long the device sits idle between decode steps, waiting for the host to dispatch the next one.

This is host time NOT hidden behind device time, measured directly: a step's device work ends when its
sampled ids are ready, and the device has nothing to run until the host dispatches the next step's forward.
With overlap scheduling the host builds step N+1 while step N runs, so the gap is zero whenever the host is
faster than the device. A watcher thread waits on each step's sampled ids (`block_until_ready` releases the
GIL, so the wait costs the scheduler thread nothing) and stamps when they became ready. The stamp needs the GIL
back, which a busy scheduler thread holds for up to `sys.getswitchinterval()` (5 ms by default): the meter
lowers the interval to SWITCH_INTERVAL_S while it runs, so a stamp is at most that late.

On a CPU backend the "device" runs on the same cores as the host: host work there also slows a device step
it overlaps; that shows in the step time, not in this gap. Benchmarks only: the meter is a step observer
(engine/runner/step_executor.py) attached by `measure_device_idle`.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

SWITCH_INTERVAL_S = 2e-5  # seconds; how late a readiness stamp can be (see the module docstring)


class Readiness(Protocol):
    """What the meter waits on: a jax.Array (the step's sampled ids)."""

    def block_until_ready(self) -> object: ...


class DeviceIdleMeter:
    """Sums max(0, dispatch of decode step N+1 - sampled ids of decode step N ready), seconds, over
    consecutive decode steps. As a step observer it calls `watch(tokens)` when a decode step's sampling is
    dispatched and `dispatched(t)` once the next decode forward's call returned (`t`: seconds of `clock`);
    `idle_s()` waits for the watched steps and returns (idle seconds, pairs counted).

    `clock`: the seconds the watcher stamps a step's readiness with; the times passed to `dispatched` must
    come from the same clock (tests drive a manual one, so no result depends on how fast the machine is).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._queue: queue.SimpleQueue[tuple[int, Readiness] | threading.Event] = queue.SimpleQueue()
        self._ready_at: dict[int, float] = {}
        self._pairs: list[tuple[int, float]] = []  # (watched step, next forward's dispatch time)
        self._watched = 0
        self._pending: int | None = None  # the last watched step not yet paired with a dispatch
        self._after_decode = False  # the last forward observed was a decode step
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        threading.Thread(target=self._run, name="device-idle-meter", daemon=True).start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            step, array = item
            array.block_until_ready()
            self._ready_at[step] = self._clock()

    def watch(self, tokens: Readiness) -> None:
        """A decode step's last device output (its sampled ids [B] int32) was just dispatched."""
        self._pending = self._watched
        self._queue.put((self._watched, tokens))
        self._watched += 1

    def dispatched(self, now: float) -> None:
        """The next decode step's forward is dispatched now; pairs it with the last watched step."""
        if self._pending is not None:
            self._pairs.append((self._pending, now))
        self._pending = None

    def break_pair(self) -> None:
        """A non-decode step ran: the next decode forward does not follow a decode step."""
        self._pending = None

    # ---- the step-observer hooks (engine/runner/step_executor.py StepObserver) ----
    def forward_dispatched(self, decode: bool, start: float, end: float) -> None:
        """A decode forward right after a decode step pairs with it; any other step breaks the pair."""
        if decode and self._after_decode:
            self.dispatched(end)
        else:
            self.break_pair()
        self._after_decode = decode

    def sample_dispatched(self, tokens: Readiness) -> None:
        self.watch(tokens)

    def tokens_read(self, wait_s: float) -> None:
        pass

    def idle_s(self) -> tuple[float, int]:
        """(seconds the device waited for the host over the paired steps, number of pairs); blocks until every
        watched step is ready."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        idle = sum(max(0.0, at - self._ready_at[step]) for step, at in self._pairs)
        return idle, len(self._pairs)

    def close(self) -> None:
        """Restore the interpreter's switch interval (the watcher thread stays parked on its empty queue)."""
        sys.setswitchinterval(self._switch_interval)


@contextlib.contextmanager
def measure_device_idle(runner: Any) -> Iterator[DeviceIdleMeter]:
    """A meter attached to ``runner.observers`` (a ModelRunner's StepObservers) for the block: detached, and
    the switch interval restored, when the block ends, raising or not."""
    meter = DeviceIdleMeter()
    try:
        with runner.observers.attach(meter):
            yield meter
    finally:
        meter.close()
