"""Scheduler health: what `/health` reports, kept by the scheduler thread and read by any thread.

The server is healthy when warm-up has passed, the scheduler thread is alive, no failure left the
device cache in doubt (a fatal error), and no step has run longer than `--watchdog-timeout` seconds.
docs/internals.md ("Failures and health") describes who sets what.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthSnapshot:
    """One consistent reading of the scheduler's health (contract 4 of the coordination notes).

    Attributes:
        alive: the scheduler thread is running.
        warmed_up: the warm-up request passed (True for an Engine that is not behind launch_server).
        step_started: the HealthState clock's seconds (time.monotonic()) at which the running step began;
            None between steps.
        fatal_error: why the server cannot serve any more (the device cache is not known to be intact,
            the loop kept failing, the thread died); None while it can.
        cache_intact: the donated device cache survived every failed step.
        last_error: the last failure the scheduler recovered from (for logs and /get_server_info).
        read_at: the same clock's seconds when this reading was taken; `problem` measures the running step
            against it.
    """

    alive: bool
    warmed_up: bool
    step_started: float | None
    fatal_error: str | None
    cache_intact: bool
    last_error: str | None
    read_at: float

    def problem(self, watchdog_timeout: float | None, now: float | None = None) -> str | None:
        """Why the server is unhealthy now, or None when healthy.

        Args:
            watchdog_timeout: seconds a step may run (SGLang's --watchdog-timeout); None or <= 0: no limit.
            now: the clock's seconds to judge at (default: `read_at`, when the reading was taken).
        """
        if not self.warmed_up:
            return "warm-up has not passed yet"
        if not self.alive:
            return f"the scheduler thread is not running ({self.fatal_error or 'stopped'})"
        if self.fatal_error is not None:
            return self.fatal_error
        if watchdog_timeout and watchdog_timeout > 0 and self.step_started is not None:
            running = (self.read_at if now is None else now) - self.step_started
            if running > watchdog_timeout:
                return f"a step has been running for {running:.0f} s (--watchdog-timeout {watchdog_timeout:g} s)"
        return None


class HealthState:
    """The mutable state behind HealthSnapshot; written by the scheduler thread (and warm-up), read anywhere.

    `clock`: seconds for step starts and readings (default time.monotonic); tests set a manual one so the
    watchdog fires by construction, not after a real wait.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.warmed_up = True
        self.step_started: float | None = None
        self.fatal_error: str | None = None
        self.cache_intact = True
        self.last_error: str | None = None

    def step_begins(self) -> None:
        self.step_started = self.clock()

    def step_ends(self) -> None:
        self.step_started = None

    def recovered(self, error: str) -> None:
        with self._lock:
            self.last_error = error

    def fatal(self, error: str, cache_intact: bool = True) -> None:
        """Mark the server as unable to serve (the first cause is kept)."""
        with self._lock:
            if self.fatal_error is None:
                self.fatal_error = error
            self.cache_intact = self.cache_intact and cache_intact
            self.last_error = error

    def snapshot(self, alive: bool) -> HealthSnapshot:
        with self._lock:
            return HealthSnapshot(alive=alive, warmed_up=self.warmed_up, step_started=self.step_started,
                                  fatal_error=self.fatal_error, cache_intact=self.cache_intact,
                                  last_error=self.last_error, read_at=self.clock())
