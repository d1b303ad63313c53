"""Decode-step timing for the benchmarks: wall time between decode steps, host time blocked on the device, and
the device time of one step replayed on an idle engine.

`DecodeTimer` is a step observer (engine/runner/step_executor.py `StepObserver`): attach it to a runner with
``runner.observers.attach(timer)`` and its `stats` accumulate over the decode steps of the block.
`time_decode_step` replays the decode programs back to back without the scheduler; `time_verify_cycle` replays a
speculative verify step's programs (verify, sampling, commit, draft, carry) the same way, and
`time_cycle_programs` each of those programs alone. All go through one timing loop (`replay`);
`recorded_programs` lists the compiled programs a block dispatches. `replay_rows_layout` and
`replay_ids` lay out replayed rows (written positions on the trash page, a GDN slot a row, distinct ids) for
these replays and the prefill benchmark's (bench/prefill_step.py), which times its steps with `replay` too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner, SamplingBatch
from sglang_tpu_qwen.engine.runner.spec_programs import split_accepted
from sglang_tpu_qwen.engine.scheduler.speculative import NO_SNAPSHOTS
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
    the trash page and its own GDN slot (:func:`replay_rows_layout`), each with its own fixed token id (seeded,
    distinct; ``[B, 1]`` int32, ``token_src`` None). Distinct ids make the MoE layers route rows as a real batch
    does: rows with one input would all pick the same top-k experts, and the grouped matmuls
    would read k experts' weights instead of the ~all a real batch touches (seen on the v5e: 0.155 ms per
    268 MB expert stack, faster than HBM allows). ``token_src`` is data in the step program, so this is the
    overlapped step's program (-1 rows read the host's ids)."""
    b, ids, page_table, slots = _replay_rows(runner, rows, context, tokens=1, last_position=context - 1)
    batch = ForwardBatch(ForwardMode.DECODE, ids, np.full(b, context - 1, np.int32), np.ones(b, np.int32),
                         page_table, slots, None)
    return batch, SamplingBatch.greedy(b)


def verify_replay_batch(runner: ModelRunner, rows: int,
                        context: int) -> tuple[ForwardBatch, SamplingBatch, np.ndarray]:
    """The verify step, its greedy sampling and its commit's snapshot array that :func:`time_verify_cycle`
    replays (speculative decoding on, ``k = runner.spec_steps``, ``T = k + 1``): ``rows`` rows padded to their
    decode bucket (B rows), each feeding ``T`` distinct seeded token ids (``[B, T]`` int32: its last token and k
    drafts, so the MoE layers route the rows as a real batch, see :func:`replay_batch`) at positions
    ``context - 1 .. context + k - 1`` after ``context - 1`` cached tokens; the pages of every position the step
    and its drafts write (up to ``context + 2k - 2``: the drafts' recursive MTP positions) are the trash page,
    each row has its own GDN slot (:func:`replay_rows_layout`), ``token_src`` None (host ids). Sampling:
    ``B * T`` greedy rows. Snapshots: ``[B, 2]`` int32 (slot 0: none written; position NO_SNAPSHOTS: never lags),
    as the scheduler passes for a server without decode snapshots (engine/scheduler/speculative.py ``commit``).

    Raises:
        ValueError: speculative decoding is off, or the positions do not fit the decode bucket's page table."""
    k = runner.spec_steps
    if not k:
        raise ValueError("speculative decoding is off (--speculative-algorithm)")
    t = k + 1
    b, ids, page_table, slots = _replay_rows(runner, rows, context, tokens=t, last_position=context + 2 * k - 2)
    batch = ForwardBatch(ForwardMode.TARGET_VERIFY, ids, np.full(b, context - 1, np.int32), np.full(b, t, np.int32),
                         page_table, slots, None)
    snaps = np.zeros((b, 2), np.int32)
    snaps[:, 1] = NO_SNAPSHOTS
    return batch, SamplingBatch.greedy(b * t), snaps


def _replay_rows(runner: ModelRunner, rows: int, context: int, *, tokens: int,
                 last_position: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(B, ids [B, tokens] distinct seeded int32, page table [B, P] over arbitrary pages with the trash page at
    the columns of positions ``context - 1 .. last_position``, slot ids [B] (a running slot a row)) of the
    decode bucket of ``rows`` rows. ValueError when ``last_position`` is past the bucket's page table."""
    sizing = runner.sizing
    ps = sizing.page_size
    bucket = runner.buckets.decode_bucket(-(-rows // sizing.dp))
    b, pages = bucket.batch, bucket.pages
    if last_position >= pages * ps:
        raise ValueError(f"position {last_position} (context {context}) is past the decode bucket's page table "
                         f"({pages} pages x {ps} = {pages * ps} tokens): raise --context-length")
    page_table, slots = replay_rows_layout(runner, b, pages, np.full(b, context - 1), np.full(b, last_position),
                                           real_per_rank=-(-rows // sizing.dp))
    return b, replay_ids(runner.config.vocab_size, (b, tokens)), page_table, slots


def replay_rows_layout(runner: ModelRunner, batch: int, pages: int, first: np.ndarray, last: np.ndarray, *,
                       real_per_rank: int | None = None,
                       row_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The page table and GDN slots of ``batch`` replayed rows on an IDLE runner: ``[batch, pages]`` int32 global page
    ids, row b's columns of positions ``first[b] .. last[b]`` (the positions a replayed step writes) on its DP
    rank's trash page, every other column an arbitrary page of its rank (read only: attention reads whatever KV is
    there); and ``[batch]`` int32 slot ids, a running slot of its rank per row (distinct up to the rank's running
    slots, then repeating), chosen by ``row_ids [batch]`` (default the row's index in its rank: pass a request's
    own index to keep its slot across steps); rows past ``real_per_rank`` in their rank are padding rows on the
    rank's trash slot, as serving's are. Rows are laid out by rank as the scheduler lays them out (rank r: rows
    ``[r * batch / dp, (r + 1) * batch / dp)``). ``first`` / ``last``: ``[batch]`` int token positions
    (``last < pages * page_size``).

    A slot a row, as serving has: the GDN kernel's pipeline does not fetch again (or write back) a state block
    whose index repeats between consecutive grid steps, so rows sharing one slot (the trash slot, before) made a
    short step with one grid step a row read and write one state instead of B (v5e, 64-row MTP cycle: the commit's
    GDN calls 0.196 ms each where bench.kernels' distinct slots take 0.598). An idle runner's running slots hold
    no live state, so writing them changes nothing served later: a request's first step reads zeros (``fresh``) or
    a copied snapshot, never what a slot held (``--debug-nan-fill-freed-slots`` checks it), and snapshots live in
    the slots past them. The replay reads whatever they hold (with that flag, NaN: do not time with it)."""
    sizing = runner.sizing
    dp, ps, num_pages = sizing.dp, sizing.page_size, sizing.num_pages
    usable = num_pages - 1
    page_table = (1 + (np.arange(batch * pages).reshape(batch, pages) % usable)).astype(np.int32)
    cols = np.arange(pages)[None, :]
    written = (cols >= (np.asarray(first)[:, None] // ps)) & (cols <= (np.asarray(last)[:, None] // ps))
    page_table[written] = 0
    rank = np.arange(batch) // (batch // dp)
    if dp > 1:
        page_table += (rank * num_pages)[:, None].astype(np.int32)
    local = np.arange(batch) % (batch // dp)  # the row's index within its rank
    ids = local if row_ids is None else np.asarray(row_ids)
    slots = rank * sizing.num_slots + 1 + ids % sizing.max_running_per_rank
    if real_per_rank is not None:
        slots = np.where(local < real_per_rank, slots, rank * sizing.num_slots)
    return page_table, slots.astype(np.int32)


def replay_ids(vocab_size: int, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded token ids of ``shape`` (int32 in ``[0, vocab_size)``), all distinct where the vocabulary has as many
    (so the MoE layers route the replayed tokens as a real batch's, see :func:`replay_batch`), else drawn with
    repeats."""
    size = int(np.prod(shape))
    return np.random.default_rng(0).choice(vocab_size, size=shape, replace=size > vocab_size).astype(np.int32)


class ReplayTime(NamedTuple):
    """Seconds per replayed decode step: ``step_s`` from the first dispatch to the last step's tokens ready (the
    device time when the host keeps ahead), ``dispatch_s`` the dispatching thread's CPU time per step (the host's
    own work for one step's programs). A ``dispatch_s`` near ``step_s`` means the host, not the device, set the
    pace."""

    step_s: float
    dispatch_s: float


def time_decode_step(runner: ModelRunner, rows: int, context: int, iters: int = 20, windows: int = 3,
                     warmup: int = 2) -> ReplayTime:
    """Seconds per greedy decode step (forward, sampling and keep_sampled programs) of :func:`replay_batch`: the
    medians over `windows` windows of `iters` steps dispatched back to back with one wait at the end, so host
    dispatch overlaps the device, after `warmup` untimed steps. For benchmarks on an IDLE engine only (the rows
    write the trash page and slot); observers do not see these steps."""
    batch, sampling = replay_batch(runner, rows, context)

    def step() -> jax.Array:
        out = runner.sample(runner.forward(batch), sampling)
        runner.keep_sampled(out)
        return out.tokens

    timed, _ = replay(runner, step, iters, windows, warmup)
    return timed


class CycleReplay(NamedTuple):
    """A replayed verify cycle (:func:`time_verify_cycle`): ``step_s`` / ``dispatch_s`` as in ReplayTime, per
    cycle; from the last cycle (device values read after the timing): ``accept_length`` the mean tokens a row
    accepted (1.0: no draft), ``distinct_sampled`` how many distinct ids its ``B * T`` positions sampled and
    ``distinct_drafts`` how many distinct ids its ``B * k`` drafts hold (few of either would route the MoE
    layers of the next programs like one row)."""

    step_s: float
    dispatch_s: float
    accept_length: float
    distinct_sampled: int
    distinct_drafts: int


def time_verify_cycle(runner: ModelRunner, rows: int, context: int, iters: int = 20, windows: int = 3,
                      warmup: int = 2) -> CycleReplay:
    """Seconds per speculative draft + verify cycle of :func:`verify_replay_batch`, timed as
    :func:`time_decode_step` times a step (same loop, medians of `windows` x `iters`, `warmup` untimed).

    One cycle is what the scheduler dispatches for one verify step (engine/scheduler/scheduler.py ``launch`` and
    speculative.py ``commit``), through the same runner calls: ``runner.verify`` (the verify program),
    ``runner.sample_verify`` (nothing for these greedy rows: the commit samples them) and ``runner.commit`` (the
    commit program: greedy sampling of the ``B * (k + 1)`` positions, accepted counts, GDN states, drafts and
    carry). Each cycle's programs follow the last one's on the device through the donated cache, as in serving;
    unlike serving, the host reads nothing between cycles (no round trip: the scheduler reads each step's
    accepted array while the next verify step runs) and every cycle feeds the same host ids (a carried row's ids
    come from the carry: the same verify program, another input). The commit writes each row's slot, no decode
    snapshot. For IDLE engines only; observers do not see these steps, and the kept ids and carry are put back
    afterwards.

    Raises:
        ValueError: as :func:`verify_replay_batch`."""
    batch, sampling, snaps = verify_replay_batch(runner, rows, context)

    def cycle() -> jax.Array:
        step = runner.verify(batch)
        return runner.commit(step, batch, runner.sample_verify(step, sampling), snaps)

    timed, accepted = replay(runner, cycle, iters, windows, warmup)
    got, _, drafts, tokens = split_accepted(np.asarray(accepted), runner.spec_steps)
    return CycleReplay(timed.step_s, timed.dispatch_s, float(got.mean()), len(set(tokens.tolist())),
                       len(set(drafts.ravel().tolist())))


CYCLE_PROGRAMS = ("verify", "commit")  # one greedy verify step's, in dispatch order


def time_cycle_programs(runner: ModelRunner, rows: int, context: int, iters: int = 5, windows: int = 3,
                        warmup: int = 1) -> dict[str, ReplayTime]:
    """Seconds per call of each program of :func:`time_verify_cycle`'s cycle replayed ALONE (CYCLE_PROGRAMS:
    the verify program, then the commit program, each through its own runner call), with the same timing loop
    (medians of `windows` x `iters` calls dispatched back to back, after `warmup` untimed). The commit reads the
    outputs of one untimed verify call (the same arrays every call: it re-commits the rows' slots and re-drafts
    from the same accepted counts). A program alone pays its own launch and whatever the one before it left
    unfinished in a cycle, so the sum may differ from the cycle's time a little. For IDLE engines only; observers
    do not see these calls, and the kept ids and carry are put back afterwards.

    Raises:
        ValueError: as :func:`verify_replay_batch`."""
    batch, sampling, snaps = verify_replay_batch(runner, rows, context)
    with runner.side_steps():
        step = runner.verify(batch)
        sampled = runner.sample_verify(step, sampling)
        jax.block_until_ready(step.hidden)
        calls: dict[str, Callable[[], Any]] = {
            "verify": lambda: runner.verify(batch).last,
            "commit": lambda: runner.commit(step, batch, sampled, snaps),
        }
        return {name: replay(runner, calls[name], iters, windows, warmup)[0] for name in CYCLE_PROGRAMS}


def replay(runner: ModelRunner, step: Callable[[], Any], iters: int, windows: int,
            warmup: int) -> tuple[ReplayTime, Any]:
    """The timing loop of the replays: `warmup` untimed calls of `step` (each waited for), then `windows` windows
    of `iters` calls dispatched back to back, each window waited for once at its end (on what the last call
    returned: device arrays). Returns the medians (ReplayTime, per call) and the last call's result. Runs inside
    ``runner.side_steps()``.

    The dispatch figure is the calling thread's CPU time (``time.thread_time``), not wall time: the runtime lets
    the host run only about 32 programs ahead of the device (PJRT's enqueue limit) and then blocks each dispatch
    until one finishes, so over a window of ``iters`` calls the wall time of dispatching approaches the device
    time (on the v5e it matched ``step_s x (1 - 32 / programs dispatched)`` for every row count)."""
    times, dispatch = [], []
    out: Any = None
    with runner.side_steps():
        for _ in range(warmup):
            jax.block_until_ready(step())
        for _ in range(windows):
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(iters):
                out = step()
            dispatch.append((time.thread_time() - cpu) / iters)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / iters)
    return ReplayTime(float(np.median(times)), float(np.median(dispatch))), out


@contextlib.contextmanager
def recorded_programs(runner: ModelRunner) -> Iterator[list[tuple]]:
    """The keys of the compiled programs the runner dispatches inside the block (engine/runner/programs.py
    ``ProgramTable.get``: every step, sampling and speculative program goes through it), in call order, repeats
    included. For benchmarks and tests; the table's lookup is restored when the block ends."""
    table = runner.programs
    keys: list[tuple] = []
    get = table.get

    def spy(key: tuple) -> Any:
        keys.append(key)
        return get(key)

    table.get = spy  # type: ignore[method-assign]
    try:
        yield keys
    finally:
        del table.get
