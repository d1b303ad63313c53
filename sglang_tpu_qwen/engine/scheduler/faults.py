"""Fault injection: make the forward, the sampler or the scheduler loop raise on purpose (tests only).

Armed from a test (`engine.scheduler.faults.arm(...)`) or, for a server process, from the environment:

    SGLANG_TPU_QWEN_FAULT="forward@0"                 the forward of step 0 (the first step) raises
    SGLANG_TPU_QWEN_FAULT="sampler@rid=bad"           every sampling of a batch holding a request whose rid
                                                      starts with "bad" raises
    SGLANG_TPU_QWEN_FAULT="forward@rid=doom:consume"  the forward raises after consuming the donated cache
    SGLANG_TPU_QWEN_FAULT="loop@2"                    the loop body raises outside the step on iteration 2

Several faults are separated by ";". A fault fires `times` times (1 from the environment; `arm` takes any
count, None for always). Without the variable and without `arm`, every check is one attribute test.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENV = "SGLANG_TPU_QWEN_FAULT"
POINTS = ("forward", "sampler", "loop")


class InjectedFault(RuntimeError):
    """The exception an armed fault raises."""


class InjectedThreadKill(BaseException):
    """Raised by a `kill_thread` fault: not an Exception, so it escapes the loop's failure handling and ends
    the scheduler thread (the path of an unexpected BaseException)."""


@dataclass
class Fault:
    """One armed fault.

    Attributes:
        point: "forward", "sampler" or "loop".
        at: the counter value of `point` (forward and sampler count steps, loop counts iterations) at which
            it fires; None: any.
        rid: fires only when a request of the step has an rid starting with this; None: any step.
        skip: matching passes to let through before it fires (e.g. 1: not the request's first step).
        times: firings left; None: unlimited.
        consume_cache: forward only: delete the device cache before raising (what a failure after the
            donated buffers were consumed leaves behind).
        kill_thread: raise InjectedThreadKill instead of InjectedFault.
        block: wait on this event before going on (a stalled step, for the watchdog); no raise.
    """

    point: str
    at: int | None = None
    rid: str | None = None
    skip: int = 0
    times: int | None = 1
    consume_cache: bool = False
    kill_thread: bool = False
    block: threading.Event | None = None


class FaultInjector:
    """The scheduler's fault points; `check(point, rids)` raises when an armed fault matches."""

    def __init__(self, spec: str | None = None) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._counts = dict.fromkeys(POINTS, 0)
        for item in (spec or "").split(";"):
            if item.strip():
                self._faults.append(parse_fault(item.strip()))

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(os.environ.get(ENV))

    def arm(self, point: str, *, after: int | None = None, rid: str | None = None, skip: int = 0,
            times: int | None = 1, consume_cache: bool = False, kill_thread: bool = False,
            block: threading.Event | None = None) -> Fault:
        """Arm a fault at `point`, firing at the `after`-th next check of it (0: the next one; None: any) for
        steps holding an rid starting with `rid` (None: any), after letting `skip` matching passes through.
        Returns it (`disarm` takes it back)."""
        if point not in POINTS:
            raise ValueError(f"fault point must be one of {', '.join(POINTS)}, got {point!r}")
        with self._lock:
            at = None if after is None else self._counts[point] + after
            fault = Fault(point, at, rid, skip, times, consume_cache, kill_thread, block)
            self._faults.append(fault)
        return fault

    def disarm(self, fault: Fault | None = None) -> None:
        """Remove one fault, or all of them."""
        with self._lock:
            self._faults = [] if fault is None else [f for f in self._faults if f is not fault]

    def check(self, point: str, rids: Iterable[str] = (), runner: Any = None) -> None:
        """Count one pass through `point`; raise (or block) when an armed fault matches.

        runner: the ModelRunner whose `cache` a consume_cache fault deletes.
        """
        if not self._faults:
            self._counts[point] += 1
            return
        with self._lock:
            count = self._counts[point]
            self._counts[point] += 1
            rid_list = list(rids)
            fault = next((f for f in self._faults if f.point == point and (f.at is None or f.at == count)
                          and (f.rid is None or any(r.startswith(f.rid) for r in rid_list))), None)
            if fault is None:
                return
            if fault.skip > 0:
                fault.skip -= 1
                return
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
        if fault.block is not None:
            fault.block.wait()
            return
        if fault.consume_cache and runner is not None:
            import jax

            for leaf in jax.tree.leaves(runner.cache):
                leaf.delete()
        message = f"injected fault at {point} (pass {count}, rids {rid_list})"
        if fault.kill_thread:
            raise InjectedThreadKill(message)
        raise InjectedFault(message)


def parse_fault(item: str) -> Fault:
    """`point@N`, `point@rid=PREFIX`, optionally followed by `:consume` and/or `:kill` (see module docstring)."""
    head, *flags = item.split(":")
    point, _, where = head.partition("@")
    if point not in POINTS or not where:
        raise ValueError(f"bad {ENV} entry {item!r}: expected point@N or point@rid=PREFIX, point in {POINTS}")
    fault = Fault(point)
    if where.startswith("rid="):
        fault.rid = where[4:]
    else:
        fault.at = int(where)
    for flag in flags:
        if flag == "consume":
            fault.consume_cache = True
        elif flag == "kill":
            fault.kill_thread = True
        elif flag == "always":
            fault.times = None
        else:
            raise ValueError(f"bad {ENV} flag {flag!r} in {item!r} (consume, kill, always)")
    return fault
