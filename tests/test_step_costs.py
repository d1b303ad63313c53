"""Adaptive drafting's step costs (engine/scheduler/step_costs.py): medians of the steps' wall times, so a few
steps timed across an idle gap or a prefill do not decide the step kind for good."""

from __future__ import annotations

import pytest

from sglang_tpu_qwen.engine.scheduler.step_costs import COST_WINDOW, StepCosts


def test_a_step_runs_from_its_launch_or_the_previous_read() -> None:
    costs = StepCosts()
    costs.start("decode", 8, now=0.0)
    costs.start("decode", 8, now=0.001)  # overlapped: launched while the first one ran
    costs.done(now=0.010)
    costs.done(now=0.018)  # read 8 ms after the first read, not 17 ms after its own launch
    assert costs.seconds("decode", 8) == pytest.approx((0.010 + 0.008) / 2)
    assert costs.seconds("verify", 8) is None and costs.seconds("decode", 4) is None
    assert costs.as_dict() == {"verify": {}, "decode": {"8": pytest.approx(0.009)}}


def test_outliers_do_not_move_the_median() -> None:
    """Two steps of 2 s among 3 ms ones (what an exponential average turned into a verify cost of 114 ms on
    the chip, after which the server stopped verifying) leave the estimate at 3 ms; the window then forgets
    them."""
    costs, t = StepCosts(), 0.0
    for i in range(COST_WINDOW):
        costs.start("verify", 32, now=t)
        t += 2.0 if i in (3, 6) else 0.003
        costs.done(now=t)
    assert costs.seconds("verify", 32) == pytest.approx(0.003)
    for _ in range(COST_WINDOW):
        costs.start("verify", 32, now=t)
        t += 0.004
        costs.done(now=t)
    assert costs.seconds("verify", 32) == pytest.approx(0.004)


def test_dropped_failed_and_fixed() -> None:
    costs = StepCosts()
    costs.start("decode", 1, now=0.0)
    costs.start("verify", 1, now=0.0)
    costs.drop_last()  # the verify step was not launched
    costs.done(now=0.002)
    assert costs.seconds("decode", 1) == pytest.approx(0.002) and costs.seconds("verify", 1) is None
    costs.start("verify", 1, now=1.0)
    costs.clear()  # a failed step is never read
    costs.done(now=5.0)
    assert costs.seconds("verify", 1) is None
    fixed = StepCosts.fixed({"verify": {4: 2.0}, "decode": {4: 1.0}})
    fixed.start("verify", 4, now=0.0)
    fixed.done(now=100.0)
    assert (fixed.seconds("verify", 4), fixed.seconds("decode", 4)) == (2.0, 1.0)
