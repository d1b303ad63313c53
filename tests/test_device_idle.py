"""DeviceIdleMeter: the device's idle time between decode steps, with step ends and host gaps set by
construction. A step here is a gated stand-in for a step's sampled-ids array (XLA:CPU runs a program with a
host callback synchronously at dispatch, so a real program cannot be held open by the test): its
block_until_ready returns once the test opens the gate, as a device array's does once the device finished.
Time is a manual clock the test sets, so no result depends on how fast the machine runs the watcher thread."""

from __future__ import annotations

import sys
import threading
import time

import jax.numpy as jnp
import pytest

from sglang_tpu_qwen.bench.device_idle import SWITCH_INTERVAL_S, DeviceIdleMeter, measure_device_idle
from sglang_tpu_qwen.engine.runner.step_executor import StepObservers

HANG_GUARD_S = 60.0  # only ends a test whose watcher never stamps; no outcome depends on it


class GatedStep:
    """A step in flight until `finish()`; block_until_ready waits for it like a device array's."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def block_until_ready(self) -> GatedStep:
        self._done.wait()
        return self


class ManualClock:
    """Seconds the test sets; `finish_at` ends a step at a given time and waits for the watcher's stamp."""

    def __init__(self) -> None:
        self.now = 0.0
        self._reads = threading.Semaphore(0)

    def __call__(self) -> float:
        now = self.now
        self._reads.release()
        return now

    def finish_at(self, step: GatedStep, t: float) -> None:
        self.now = t  # set before the gate opens: the watcher reads the clock only after it
        step.finish()
        assert self._reads.acquire(timeout=HANG_GUARD_S), "the watcher never stamped the step"


def test_idle_is_zero_when_the_next_step_is_dispatched_while_the_device_runs():
    clock = ManualClock()
    meter = DeviceIdleMeter(clock)
    try:
        for i in range(5):
            step = GatedStep()
            meter.watch(step)
            meter.dispatched(10.0 * i + 1)  # the next step goes out before this one finishes
            clock.finish_at(step, 10.0 * i + 2)
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    assert (idle, pairs) == (0.0, 5)


def test_idle_counts_host_time_after_the_device_finished():
    """Synchronous scheduling: step i ends at 10i + 3 and the next is dispatched at 10(i + 1), 7 s of idle
    device per pair; the last step is followed by an extend step, so it pairs with nothing."""
    clock = ManualClock()
    meter = DeviceIdleMeter(clock)
    try:
        for i in range(5):
            if i:
                meter.dispatched(10.0 * i)
            step = GatedStep()
            meter.watch(step)
            clock.finish_at(step, 10.0 * i + 3)
        meter.break_pair()  # an extend step ran: the next decode step does not follow a decode step
        meter.dispatched(100.0)
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    assert pairs == 4
    assert idle == pytest.approx(4 * 7.0)


def test_meter_lowers_the_switch_interval_and_restores_it():
    """The watcher's stamp needs the GIL a busy scheduler thread holds for up to the switch interval (5 ms by
    default): the meter lowers it while it runs and puts the previous value back, also when the measured block
    raises."""
    before = sys.getswitchinterval()
    assert before != SWITCH_INTERVAL_S
    runner = _Runner()
    with pytest.raises(RuntimeError, match="timed run failed"), measure_device_idle(runner) as meter:
        assert runner.observers.attached == (meter,)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        raise RuntimeError("timed run failed")
    assert runner.observers.attached == ()
    assert sys.getswitchinterval() == pytest.approx(before)


class _Runner:
    """The part of a ModelRunner the meter attaches to: its StepObservers."""

    def __init__(self) -> None:
        self.observers = StepObservers()


def test_steps_seen_as_an_observer_pair_only_consecutive_decode_steps():
    """The runner's hooks: a decode forward pairs with the decode step before it; an extend step between two
    decode steps breaks the pair."""
    meter = DeviceIdleMeter()
    try:
        for decode in (True, True, False, True, True):
            meter.forward_dispatched(decode, time.perf_counter(), time.perf_counter())
            if decode:
                meter.sample_dispatched(jnp.arange(4))
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    assert pairs == 2 and idle >= 0.0


def test_a_real_device_array_is_watched():
    meter = DeviceIdleMeter()
    start = time.perf_counter()
    try:
        meter.watch(jnp.arange(4) * 2)
        meter.dispatched(time.perf_counter())
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    assert pairs == 1 and 0.0 <= idle <= time.perf_counter() - start
