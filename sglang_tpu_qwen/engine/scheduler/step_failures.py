"""What a failed step, a failed loop iteration or a dead scheduler thread does to the requests.

One design (docs/internals.md, "Failures and health"):

- A step that raises with the device cache intact (every donated buffer alive and computed) rewinds the
  step's requests: their memory is released without giving it to the prefix cache (its content is in
  doubt) and they wait to re-prefill prompt + output, exactly like a retraction. When the step held more
  than one request they become *suspects* and run one per step until each has passed a step; a step that
  fails with a single request (a suspect or not) fails that request with a 500 finish_reason. So a request
  whose values break the step fails alone and the others finish as if nothing happened.
- A step that leaves the cache consumed or poisoned (a failure after the forward's donation) is fatal:
  every request fails with a 500 and /health reports the server unhealthy; new requests get a 503.
- An exception outside a step (inbox drain, usage report, admission) is logged and the loop goes on;
  MAX_LOOP_FAILURES in a row are fatal. A thread that dies anyway fails every request it held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from sglang_tpu_qwen.engine.io.errors import failure_reason
from sglang_tpu_qwen.engine.observability.health import HealthState

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.io.request import Request
    from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch

logger = logging.getLogger(__name__)

MAX_LOOP_FAILURES = 3


def cache_intact(cache: Any) -> bool:
    """True when every leaf of the device cache is alive and its last computation succeeded."""
    leaves = jax.tree.leaves(cache)
    if any(leaf.is_deleted() for leaf in leaves):
        return False
    try:
        jax.block_until_ready(leaves)
    except Exception:  # the computation that produced it failed: its values are unknown
        return False
    return True


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class StepFailures:
    """The scheduler's failure handling (see module docstring).

    Args:
        scheduler: the Scheduler; uses its `running` / `waiting` lists, `finish(r, reason, keep)`,
            `policy.release(r, keep)` and `runner.cache`.
        health: the scheduler's HealthState.
    """

    def __init__(self, scheduler: Any, health: HealthState) -> None:
        self.s = scheduler
        self.health = health
        self._suspects: dict[int, Request] = {}
        self._loop_failures = 0

    # ---- steps -----------------------------------------------------------------------------------
    @property
    def has_suspects(self) -> bool:
        """Requests of a failed step are waiting to run alone: steps then run synchronously (no overlap), so
        a failure belongs to the one step that raised."""
        return bool(self._suspects)

    def isolate(self, batch: PickedBatch) -> PickedBatch:
        """The batch to run: a suspect runs alone (the first one in the batch), anything else unchanged."""
        for i, r in enumerate(batch.reqs):
            if id(r) in self._suspects:
                return batch.only(i)
        return batch

    def step_passed(self, batch: PickedBatch) -> None:
        """The step of `batch` completed: its requests are cleared of suspicion."""
        self._loop_failures = 0
        if self._suspects:
            for r in batch.reqs:
                self._suspects.pop(id(r), None)

    def step_failed(self, batches: Sequence[PickedBatch], exc: BaseException) -> None:
        """A step raised. `batches`: the batch being launched and, under overlap, the one in flight (whose
        tokens are lost with it); none when it failed before a batch was picked."""
        reqs: list[Request] = []
        seen: set[int] = set()
        for batch in batches:
            for r in batch.reqs:
                if id(r) not in seen:
                    seen.add(id(r))
                    reqs.append(r)
        error = describe(exc)
        logger.error("step failed (%d requests): %s", len(reqs), error, exc_info=exc)
        if not cache_intact(self.s.runner.cache):
            self.fatal(f"a step failed and the device cache is not intact: {error}", cache_ok=False)
            return
        if not reqs:
            self.loop_failed(exc)
            return
        self.health.recovered(error)
        alone = len(reqs) == 1
        reqs = [r for r in reqs if not r.finished]
        if alone:
            for r in reqs:
                self._suspects.pop(id(r), None)
                self.s.finish(r, failure_reason(f"Internal server error during the step: {error}"), keep=False)
            return
        for r in reqs:  # which one broke the step is not known: each runs alone next
            self._suspects[id(r)] = r
            self._rewind(r)

    def _rewind(self, r: Request) -> None:
        """Release r's memory (not to the prefix cache) and queue it to re-prefill prompt + output."""
        self.s.policy.release(r, keep=False)
        if not r.input_logprobs_done:
            r.input_token_logprobs.clear()
            r.input_top_logprobs.clear()
        if r in self.s.running:
            self.s.running.remove(r)
            self.s.waiting.appendleft(r)

    # ---- outside steps ---------------------------------------------------------------------------
    def loop_passed(self) -> None:
        self._loop_failures = 0

    def loop_failed(self, exc: BaseException) -> None:
        """The loop body raised outside a step: go on, unless it keeps failing."""
        self._loop_failures += 1
        logger.error("scheduler loop failed (%d in a row): %s", self._loop_failures, describe(exc), exc_info=exc)
        self.health.recovered(describe(exc))
        if self._loop_failures >= MAX_LOOP_FAILURES:
            self.fatal(f"the scheduler loop failed {self._loop_failures} times in a row: {describe(exc)}")

    def thread_died(self, exc: BaseException | None) -> None:
        """The loop ended (an uncaught BaseException, or shutdown when exc is None): fail what is left."""
        if exc is not None:
            logger.critical("scheduler thread died: %s", describe(exc), exc_info=exc)
            self.fatal(f"the scheduler thread died: {describe(exc)}")
        else:
            self.fail_all("the server is shutting down", status=503, err_type="ServiceUnavailable")

    def fatal(self, error: str, cache_ok: bool = True) -> None:
        """The server cannot serve any more: mark it unhealthy and fail every request."""
        logger.critical("server unhealthy: %s", error)
        self.health.fatal(error, cache_intact=cache_ok)
        self.fail_all(f"Internal server error: {error}")

    def fail_all(self, message: str, status: int = 500, err_type: str = "InternalServerError") -> None:
        """Finish every waiting and running request with a failure finish_reason (memory not kept)."""
        self._suspects.clear()
        for r in [*self.s.running, *self.s.waiting]:
            try:
                self.s.finish(r, failure_reason(message, status, err_type), keep=False)
            except Exception:  # one broken request must not keep the others waiting
                logger.exception("could not fail request %s", r.rid)
                for queue in (self.s.running, self.s.waiting):
                    if r in queue:
                        queue.remove(r)
                r.finish_reason = failure_reason(message, status, err_type)
                try:
                    r.sink(r.reply())
                except Exception:  # its caller is gone (an event loop closed at shutdown)
                    logger.debug("reply of failed request %s not delivered", r.rid)
