"""Decode-step timing for the benchmarks: wall time between decode steps, host time blocked on the device, and
the device time of one step replayed on an idle engine.

`DecodeTimer` is a step observer (engine/runner/step_executor.py `StepObserver`): attach it to a runner with
``runner.observers.attach(timer)`` and its `stats` accumulate over the decode steps of the block.
`time_decode_step` replays the decode programs back to back without the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner, SampleOutput, SamplingBatch
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class StepStats:
    """Decode-loop timing for benchmarks: `decode_steps` intervals between consecutive decode forwards
    (`decode_wall_s`, seconds) and the time the host spent blocked on the device reading their sampled ids
    (`decode_wait_s`). Host time of a step = wall - wait."""

    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_wait_s: float = 0.0
    decode_waits: int = 0  # decode steps whose sampled ids were read (decode_wait_s is over these)

    def reset(self) -> None:
        self.decode_steps, self.decode_wall_s, self.decode_wait_s, self.decode_waits = 0, 0.0, 0.0, 0


class DecodeTimer:
    """StepStats of the decode steps a runner runs while this observer is attached: an interval counts from
    one decode forward's start to the next one's when no other step ran between them."""

    def __init__(self) -> None:
        self.stats = StepStats()
        self._last_decode_start: float | None = None

    def forward_dispatched(self, decode: bool, start: float, end: float) -> None:
        if decode and self._last_decode_start is not None:
            self.stats.decode_steps += 1
            self.stats.decode_wall_s += start - self._last_decode_start
        self._last_decode_start = start if decode else None

    def sample_dispatched(self, tokens: jax.Array) -> None:
        pass

    def tokens_read(self, wait_s: float) -> None:
        self.stats.decode_wait_s += wait_s
        self.stats.decode_waits += 1


def replay_batch(runner: ModelRunner, rows: int, context: int) -> tuple[ForwardBatch, SamplingBatch]:
    """The decode batch and greedy sampling that :func:`time_decode_step` replays: ``rows`` rows padded to their
    decode bucket, every row at ``context`` tokens over arbitrary pages, writing position ``context - 1`` into
    the trash page and slot, each with its own fixed token id (seeded, distinct; ``[B, 1]`` int32,
    ``token_src`` None). Distinct ids make the MoE layers route rows as a real batch does: rows with one
    input (all on the trash slot's state) would all pick the same top-k experts, and the grouped matmuls
    would read k experts' weights instead of the ~all a real batch touches (seen on the v5e: 0.155 ms per
    268 MB expert stack, faster than HBM allows). ``token_src`` is data in the step program, so this is the
    overlapped step's program (-1 rows read the host's ids)."""
    sizing = runner.sizing
    dp, ps, num_pages = sizing.dp, sizing.page_size, sizing.num_pages
    bucket = runner.buckets.decode_bucket(-(-rows // dp))
    b, pages = bucket.batch, bucket.pages
    usable = num_pages - 1
    page_table = (1 + (np.arange(b * pages).reshape(b, pages) % usable)).astype(np.int32)
    page_table[:, (context - 1) // ps] = 0
    if dp > 1:
        page_table += (np.arange(b) // (b // dp))[:, None] * num_pages
        page_table[:, (context - 1) // ps] = (np.arange(b) // (b // dp)) * num_pages
    slots = ((np.arange(b) // (b // dp)) * sizing.num_slots).astype(np.int32)
    ids = np.random.default_rng(0).choice(runner.config.vocab_size, size=(b, 1), replace=False).astype(np.int32)
    batch = ForwardBatch(ForwardMode.DECODE, ids, np.full(b, context - 1, np.int32), np.ones(b, np.int32),
                         page_table, slots, None)
    return batch, SamplingBatch.greedy(b)


class ReplayTime(NamedTuple):
    """Seconds per replayed decode step: ``step_s`` from the first dispatch to the last step's tokens ready (the
    device time when the host keeps ahead), ``dispatch_s`` the host's time to dispatch one step's programs. A
    ``dispatch_s`` near ``step_s`` means the host, not the device, set the pace."""

    step_s: float
    dispatch_s: float


def time_decode_step(runner: ModelRunner, rows: int, context: int, iters: int = 20, windows: int = 3,
                     warmup: int = 2) -> ReplayTime:
    """Seconds per greedy decode step (forward, sampling and keep_sampled programs) of :func:`replay_batch`: the
    medians over `windows` windows of `iters` steps dispatched back to back with one wait at the end, so host
    dispatch overlaps the device, after `warmup` untimed steps. For benchmarks on an IDLE engine only (the rows
    write the trash page and slot); observers do not see these steps."""
    batch, sampling = replay_batch(runner, rows, context)

    def step() -> SampleOutput:
        out = runner.sample(runner.forward(batch), sampling)
        runner.keep_sampled(out)
        return out

    times, dispatch = [], []
    with runner.side_steps():
        for _ in range(warmup):
            step().tokens.block_until_ready()
        for _ in range(windows):
            start = time.perf_counter()
            for _ in range(iters):
                out = step()
            dispatch.append((time.perf_counter() - start) / iters)
            out.tokens.block_until_ready()
            times.append((time.perf_counter() - start) / iters)
    return ReplayTime(float(np.median(times)), float(np.median(dispatch)))
