"""Wall time of decode steps by kind and batch bucket, as the scheduler reads them: adaptive drafting's costs.

Adaptive drafting (engine/scheduler/speculative.py) verifies drafts when the tokens a verify step is expected
to yield exceed rho = (verify step time) / (plain decode step time) at the batch's bucket. Both times are
measured on the running server: a step's time runs from its launch (or the read of the step before it, when
the two overlapped) to its read.

Some samples are not a step's cost: the first step after the server sat idle or ran extend steps (prefill
of newly arrived requests queues before it on the device), a step whose read waited for a burst of host
work. On the chip one such sample (hundreds of ms) in an exponential average held rho above the expected
tokens, the server stopped verifying, and nothing measured verify steps again: a trained MTP layer ran at
0.5-0.7x plain decoding. So the estimate is the median of the last COST_WINDOW samples, which a few outliers
do not move, and speculative.py probes a verify step now and then while it runs plain ones.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Literal

StepKind = Literal["verify", "decode"]
COST_WINDOW = 9  # samples per (kind, bucket) in the median


class StepCosts:
    """Seconds per decode step by kind ("verify", "decode") and batch bucket (rows per DP rank's bucket).

    `start` when a step is launched, `done` when the oldest launched step is read (steps are read in launch
    order), `drop_last` when the step just asked about is not launched after all, `clear` after a failed step.
    `seconds` is the median of the last `window` samples (None before the first). `fixed` gives costs that
    measurement does not change (tests)."""

    def __init__(self, window: int = COST_WINDOW) -> None:
        self._samples: dict[StepKind, dict[int, deque[float]]] = {"verify": {}, "decode": {}}
        self._window = window
        self._started: deque[tuple[StepKind, int, float]] = deque()  # launched, not read: (kind, bucket, start)
        self._last_done = 0.0
        self._frozen = False

    @classmethod
    def fixed(cls, seconds: dict[StepKind, dict[int, float]]) -> StepCosts:
        """Costs that stay as given whatever runs."""
        costs = cls(window=1)
        for kind, by_bucket in seconds.items():
            for bucket, s in by_bucket.items():
                costs._samples[kind][bucket] = deque([s], maxlen=1)
        costs._frozen = True
        return costs

    def start(self, kind: StepKind, bucket: int, now: float | None = None) -> None:
        """A decode step of `kind` at `bucket` is launched (`now`: perf_counter seconds, default the clock)."""
        self._started.append((kind, bucket, time.perf_counter() if now is None else now))

    def done(self, now: float | None = None) -> None:
        """The oldest launched step was read: one sample, from its start (or the previous read, when later) to
        `now`."""
        now = time.perf_counter() if now is None else now
        if self._started:
            kind, bucket, t0 = self._started.popleft()
            if not self._frozen:
                window = self._samples[kind].setdefault(bucket, deque(maxlen=self._window))
                window.append(now - max(t0, self._last_done))
        self._last_done = now

    def drop_last(self) -> None:
        """The step last started is not launched (its rows all finished meanwhile)."""
        self._started.pop()

    def clear(self) -> None:
        """A step failed: the launched steps will not be read."""
        self._started.clear()

    def seconds(self, kind: StepKind, bucket: int) -> float | None:
        """The median of the last samples of `kind` at `bucket`; None before the first."""
        window = self._samples[kind].get(bucket)
        return statistics.median(window) if window else None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{kind: {bucket: seconds}} (/get_server_info's ``spec_step_seconds``)."""
        return {kind: {str(b): statistics.median(w) for b, w in by.items() if w}
                for kind, by in self._samples.items()}
