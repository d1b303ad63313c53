"""DeviceIdleMeter: the device's idle time between decode steps, with step ends and host gaps set by
construction. A step here is a gated stand-in for a step's sampled-ids array (XLA:CPU runs a program with a
host callback synchronously at dispatch, so a real program cannot be held open by the test): its
block_until_ready returns once the test opens the gate, as a device array's does once the device finished."""

from __future__ import annotations

import sys
import threading
import time

import jax.numpy as jnp
import pytest

from sglang_tpu_qwen.engine.runner.device_idle import SWITCH_INTERVAL_S, DeviceIdleMeter, measure_device_idle
from sglang_tpu_qwen.engine.runner.step_executor import StepObservers

GAP_S = 0.004
# Host gap after each finished step in the idle-counting test: long against the watcher thread's wake-up on a
# loaded 2-core machine (about 1 ms each, measured), so the lower bound below holds by construction.
LONG_GAP_S = 0.05


class GatedStep:
    """A step in flight until `finish()`; block_until_ready waits for it like a device array's."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def block_until_ready(self) -> GatedStep:
        self._done.wait()
        return self


def _busy(seconds: float) -> None:
    """Hold the GIL for `seconds`, as a scheduler thread building the next batch does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_idle_is_zero_when_the_next_step_is_dispatched_while_the_device_runs():
    meter = DeviceIdleMeter()
    try:
        for _ in range(5):
            step = GatedStep()
            meter.watch(step)
            _busy(GAP_S)  # host work while the step is still running
            meter.dispatched(time.perf_counter())  # the next step goes out before this one finishes
            step.finish()
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    assert (idle, pairs) == (0.0, 5)


def test_idle_counts_host_time_after_the_device_finished():
    meter = DeviceIdleMeter()
    start = time.perf_counter()
    try:
        for i in range(5):
            if i:
                meter.dispatched(time.perf_counter())
            step = GatedStep()
            meter.watch(step)
            step.finish()
            step.block_until_ready()
            _busy(LONG_GAP_S)  # synchronous scheduling: the next step is built only after reading this one
        meter.break_pair()  # an extend step ran: the next decode step does not follow a decode step
        meter.dispatched(time.perf_counter())
        idle, pairs = meter.idle_s()
    finally:
        meter.close()
    elapsed = time.perf_counter() - start
    assert pairs == 4
    # Each gap holds LONG_GAP_S of host work after the step finished; the stamp can only be late (the watcher
    # needs the GIL the busy loop holds), which shortens a gap, never lengthens it past the run.
    assert 4 * LONG_GAP_S * 0.5 <= idle <= elapsed


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
