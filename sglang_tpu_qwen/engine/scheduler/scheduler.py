"""Scheduler: the thread that runs continuous batching over the paged KV pool and the GDN slot pool.

Each loop iteration drains the inbox (inbox.py: new requests, aborts, cache flushes), then runs one
`step`: the policy (schedule_policy.py) admits waiting requests and picks a batch (`PickedBatch`): an
extend step (prefill chunks) or a decode step (one token per decoding request). `ScheduleBatch.build`
(schedule_batch.py) lays it out as the model's inputs (one ForwardBatch), the model runner runs it, and
the output processor (output_processor.py) applies the results: prompt logprobs, sampled tokens, stop
checks, streaming. `finish` ends a request: final reply, memory back. A serving role (scheduler_role.py;
prefill/decode disaggregation) hooks into the step.

Overlap scheduling (SGLang's; off with --disable-overlap-schedule): a step launches its batch, then reads
the previous step's sampled tokens while the device runs it. A decode row whose token is still on the
device reads it there (ForwardBatch.token_src, ModelRunner.keep_sampled), so the host builds step N+1 while
step N runs. Finish checks, stop strings and streaming apply one step late: a request that finished at step
N may have computed one more token in N+1, which is discarded (its memory is freed when N is read, and a
later user of it runs after N+1 on the device). Steps whose next batch needs the host to know the tokens run
synchronously: a grammar or penalty row with a token in flight, and every step under a PD role. Speculative
decoding overlaps verify steps the same way: a verify row reads its fed tokens and start from the carry the
step in flight leaves on the device, and that step's commit and drafts are dispatched once the step before it
is read (engine/scheduler/speculative.py).

With --dp-size N (data-parallel attention) each DP rank has its own pages, slots and radix tree
(rank_memory.py); a step runs every rank at once, rank r's rows being rows [r*B/N, (r+1)*B/N).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.io.request_images import Encode
from sglang_tpu_qwen.engine.observability.health import HealthSnapshot, HealthState
from sglang_tpu_qwen.engine.observability.metrics import Metrics
from sglang_tpu_qwen.engine.observability.profiler import StepProfiler, default_profile_dir
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner, SampleOutput, StepOutput
from sglang_tpu_qwen.engine.scheduler.faults import FaultInjector
from sglang_tpu_qwen.engine.scheduler.inbox import AbortRequest, AddRequests, FlushCache, Inbox
from sglang_tpu_qwen.engine.scheduler.output_processor import OutputProcessor
from sglang_tpu_qwen.engine.scheduler.rank_memory import RankMemory
from sglang_tpu_qwen.engine.scheduler.schedule_batch import ImageInputs, PickedBatch, ScheduleBatch
from sglang_tpu_qwen.engine.scheduler.schedule_policy import SchedulePolicy
from sglang_tpu_qwen.engine.scheduler.scheduler_role import SchedulerRole
from sglang_tpu_qwen.engine.scheduler.speculative import SpecDecoder
from sglang_tpu_qwen.engine.scheduler.step_failures import StepFailures
from sglang_tpu_qwen.model.forward_batch import ForwardMode
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_CHECK = os.environ.get("SGLANG_TPU_QWEN_CHECK_INVARIANTS") == "1"  # debug: verify memory ownership each step


@dataclass
class Launched:
    """A step whose device work was dispatched: its batch, its sampled ids (device; None: none sampled) and its
    forward's output (speculative decoding drafts from its hidden states)."""

    batch: ScheduleBatch
    sampled: SampleOutput | None
    step: StepOutput | None = None
    # A verify step's commit output (accepted counts, fed lengths, drafts, sampled tokens), on the device.
    accepted: jax.Array | None = None


class Scheduler:
    """Runs the batching loop in a background thread; other threads talk to it through `submit`/`abort`."""

    def __init__(
        self, runner: ModelRunner, tokenizer: Tokenizer, args: ServerArgs, context_length: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.runner = runner
        self.args = args
        self.metrics = metrics
        self.page_size = runner.sizing.page_size
        self.policy = SchedulePolicy(runner, args, context_length)
        self.overlap = not args.disable_overlap_schedule
        self._in_flight: Launched | None = None  # overlap: the step the device may still be running
        self.overlapped_steps = 0  # steps launched before the previous one was read
        self.device_fed_rows = 0  # decode rows whose input token came from the device (token_src >= 0)
        self.eos_ids = set(runner.config.eos_token_id) | set(tokenizer.eos_token_ids)
        self.output = OutputProcessor(runner, tokenizer, args, context_length, self.eos_ids, metrics, self.finish)
        self.role = SchedulerRole()  # prefill/decode disaggregation replaces it (disagg/roles.py, set_role)
        self._inbox = Inbox()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        # /start_profile, /stop_profile: carried out here between steps (profiler.py).
        self.profiler = StepProfiler(default_profile_dir(args.profile_dir), self._inbox.wake)
        self.health_state = HealthState()  # engine/observability/health.py: what /health reports
        self.faults = FaultInjector.from_env()  # engine/scheduler/faults.py: test-only fault points
        self.failures = StepFailures(self, self.health_state)  # engine/scheduler/step_failures.py
        self._batch = PickedBatch.idle()  # the step being launched, for StepFailures
        # A vision model's steps carry rope deltas and, with image tokens, positions and embeddings; the engine
        # sets the encoder (set_image_encoder) before any request with images comes.
        self.image_inputs = ImageInputs(runner.config.hidden_size, None) if runner.config.has_vision else None
        # Speculative decoding (--speculative-algorithm, engine/scheduler/speculative.py): decode steps verify the
        # MTP layer's drafts; under overlap a verify step's fed tokens come from the one in flight, on the device.
        self.spec = SpecDecoder(self) if runner.spec_steps else None

    def set_image_encoder(self, encode: Encode) -> None:
        """The vision encoder's call (images -> per image [num_tokens, hidden] arrays), for a vision model."""
        if self.image_inputs is None:
            raise ValueError("this model does not accept images")
        self.image_inputs = ImageInputs(self.image_inputs.hidden, encode)

    @property
    def ranks(self) -> list[RankMemory]:
        return self.policy.ranks

    @property
    def waiting(self) -> deque[Request]:
        return self.policy.waiting

    @property
    def running(self) -> list[Request]:
        return self.policy.running

    # ---- other threads -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> bool:
        """Stop the scheduler thread (waiting up to 30 s for its step). Returns whether it has stopped."""
        self._stop.set()
        self._inbox.wake()
        self._thread.join(timeout=30)
        self.profiler.close()  # a trace still running is written out
        return not self._thread.is_alive()

    def health(self) -> HealthSnapshot:
        """A consistent snapshot of the scheduler's health (engine/observability/health.py)."""
        return self.health_state.snapshot(alive=self._thread.is_alive())

    def submit(self, reqs: list[Request]) -> None:
        self._inbox.put(AddRequests(reqs))

    def abort(self, rid: str | None) -> None:
        self._inbox.put(AbortRequest(rid))

    def flush_cache(self, timeout: float = 60.0) -> bool:
        """Empty the prefix cache if no request is waiting or running (done on the scheduler thread)."""
        msg = FlushCache()
        self._inbox.put(msg)
        try:
            return msg.done.result(timeout)
        except TimeoutError:
            return False

    def wake(self) -> None:
        """Wake the loop (any thread): a role's transfer changed state."""
        self._inbox.wake()

    def set_role(self, role: SchedulerRole) -> None:
        """Attach a serving role's hooks (before start). PD roles read each step's results right after it
        (KV export, first-token hand-over), so they run without overlap."""
        self.role = role
        if role.mode != "null":
            self.overlap = False

    @property
    def kv_tokens_total(self) -> int:
        """KV tokens one request can use at most (one rank's pool)."""
        return self.ranks[0].kv_pool.num_usable * self.page_size

    def memory_usage(self) -> dict[str, Any]:
        """Pool usage summed over DP ranks (and per rank under "dp_ranks" when dp > 1). KV pages held by the
        prefix cache are not free until evicted or flushed."""
        per_rank = [m.usage() for m in self.ranks]
        if len(per_rank) == 1:
            return per_rank[0]
        usage: dict[str, Any] = {k: sum(u[k] for u in per_rank) for k, v in per_rank[0].items()
                                 if isinstance(v, int) and not isinstance(v, bool) and k != "page_size"}
        usage.update(page_size=self.page_size, radix_cache=per_rank[0]["radix_cache"], dp_ranks=per_rank)
        if "cache_query_tokens" in usage:
            queries = usage["cache_query_tokens"]
            usage["cache_hit_rate"] = usage["cache_hit_tokens"] / queries if queries else 0.0
        return usage

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Run until shutdown. Every failure is handled by StepFailures (engine/scheduler/step_failures.py): a step's
        own, one outside the step, and the thread's end (which fails whatever it still holds)."""
        died: BaseException | None = None
        try:
            while not self._stop.is_set():
                try:
                    self._loop_once()
                except Exception as e:  # outside a step: inbox, usage report, fault hook
                    self.failures.loop_failed(e)
        except BaseException as e:
            died = e
            raise
        finally:
            self.failures.thread_died(died)

    def _loop_once(self) -> None:
        self._drain_inbox()
        self.profiler.poll()
        self.faults.check("loop", [r.rid for r in self.waiting])
        if self.health_state.fatal_error is not None:
            self.failures.fail_all(f"Internal server error: {self.health_state.fatal_error}")
        if not self.waiting and not self.running and not self.role.busy and self._in_flight is None:
            self._inbox.wait(0.5)
            return
        self._batch = PickedBatch.idle()
        try:
            if not self.step():  # nothing runnable right now: do not spin
                self._inbox.wait(0.01)
            else:
                self.failures.step_passed(self._batch)
        except Exception as e:  # a failed step must not take the server down with it
            self._step_failed(e)
        finally:
            self.health_state.step_ends()
        self.failures.loop_passed()

    def _step_failed(self, exc: Exception) -> None:
        """Hand the failed step's requests to StepFailures: those being launched and, under overlap, those of
        the step in flight (its tokens are lost; the rewound requests re-prefill prompt + output)."""
        failed: list[PickedBatch] = [self._batch]
        if self._in_flight is not None:
            failed.append(self._in_flight.batch)
            self._in_flight = None
        self.failures.step_failed(failed, exc)
        for r in [*self.waiting, *self.running]:
            r.tokens_in_flight = 0
        if self.spec is not None:
            self.spec.step_failed()

    def _drain_inbox(self) -> None:
        for msg in self._inbox.drain():
            if isinstance(msg, AddRequests):
                self.waiting.extend(self.role.intercept(msg.reqs))
            elif isinstance(msg, AbortRequest):
                self._abort(msg.rid)
            elif isinstance(msg, FlushCache):
                idle = not self.waiting and not self.running
                for m in self.ranks:
                    if idle and m.prefix_cache is not None:
                        m.prefix_cache.flush()
                msg.done.set_result(idle)

    def _abort(self, rid: str | None) -> None:
        """Abort the request `rid` (all its samples), or every request when rid is None."""
        self.role.abort(rid)
        for r in [*self.waiting, *self.running]:
            if rid is None or r.rid == rid or r.rid.startswith(rid + "::"):
                self.finish(r, {"type": "abort", "message": "aborted by the client"})

    def step(self) -> bool:
        """Admit, pick one batch, launch it, read the previous one. Returns False when nothing ran."""
        self.role.poll()  # PD: admit requests whose state arrived, fail broken transfers
        for r in [r for r in self.running if r.aborted]:
            self.finish(r, {"type": "abort", "message": "aborted by the client"})
        if self._in_flight is not None and (self.failures.has_suspects or not self._can_overlap(self._in_flight)):
            self._resolve()
        self.policy.admit(self.finish)
        picked = self.policy.pick()
        if picked.mode is ForwardMode.IDLE:
            return self._resolve()
        picked = self.failures.isolate(picked)  # a suspect of a failed step runs alone
        self._batch = picked
        self.health_state.step_begins()
        if _CHECK:
            self.policy.check_memory_invariants()
        verify = self.spec is not None and picked.mode is ForwardMode.DECODE and self.spec.use_verify(picked.reqs)
        if not verify and any(r.verify_fed for r in picked.reqs):  # a plain step reads its tokens on the host
            self._resolve()
            live = [r for r in picked.reqs if not r.finished]
            picked = PickedBatch(picked.mode, live, [1] * len(live))
            if not live:
                assert self.spec is not None
                self.spec.step_dropped()
                return True
            self._batch = picked
        prev = None if self._in_flight is None else self._in_flight.batch
        if verify:
            assert self.spec is not None
            batch = self.spec.build(picked, self.eos_ids, self.runner.config.vocab_size, prev)
        else:
            batch = ScheduleBatch.build(picked, self.runner.buckets, self.eos_ids, self.runner.config.vocab_size,
                                        prev, self.image_inputs)
        # Profiling: the annotation covers this step's launch and the host work done while it runs.
        with self.profiler.step(batch.mode.name, len(batch), batch.num_extend_tokens):
            launched = self.launch(batch)
            if self._in_flight is not None:
                self.overlapped_steps += 1
                self.device_fed_rows += int((batch.forward.token_src >= 0).sum())
            self._resolve()  # the previous step's tokens, read while the device runs this one
            if launched.step is not None and launched.step.fed is not None:  # a verify step: exact starts now
                assert self.spec is not None
                launched.accepted = self.spec.commit(batch, launched.step, launched.sampled)
            self._in_flight = launched
            if not self.overlap or self.failures.has_suspects:
                self._resolve()
        return True

    def _can_overlap(self, step: Launched) -> bool:
        """Whether the next step may be built before `step`'s tokens are read: not when a grammar row (its
        mask follows the token) or a penalty row (its counts do) is waiting for one. Under speculative
        decoding only a verify step whose rows can all be carried (SpecDecoder.can_carry): an extend or plain
        decode step's drafts are drafted once its tokens are read."""
        if not self.overlap:
            return False
        if self.spec is not None:
            return step.batch.mode is ForwardMode.TARGET_VERIFY and all(
                self.spec.can_carry(r) for r in step.batch.reqs if not r.finished)
        return not any(r.grammar is not None or r.params.has_penalty
                       for r in step.batch.sampling_reqs if not r.finished)

    def launch(self, batch: ScheduleBatch) -> Launched:
        """Dispatch forward (+ prompt logprobs, which wait for it) and sampling; advance cached_len; run the
        prefix cache's snapshot copies, which must follow this step on the device. Does not wait otherwise."""
        rids = [r.rid for r in batch.reqs]
        self.faults.check("forward", rids, self.runner)
        if batch.mode is ForwardMode.TARGET_VERIFY:  # cached_len and snapshots follow the accepted tokens
            step = self.runner.verify(batch.forward)
            self.faults.check("sampler", rids)
            assert batch.sampling is not None
            sampled = self.runner.sample_verify(step, batch.sampling)  # None: its commit samples (all greedy)
            return Launched(batch, sampled, step)  # its commit and drafts follow once the step before is read
        step = self.runner.forward(batch.forward)
        self.output.input_logprobs(batch, step)
        for r, n in zip(batch.reqs, batch.extend_lens, strict=True):
            r.cached_len += n
        sampled = None
        if batch.sampling is not None:
            self.faults.check("sampler", rids)
            sampled = self.runner.sample(step, batch.sampling)
            if self.overlap:
                self.runner.keep_sampled(sampled)
            for r in batch.sampling_reqs:
                r.tokens_in_flight += 1
        for m in self.ranks:
            if m.prefix_cache is not None:
                mine = batch.reqs if len(self.ranks) == 1 else [r for r in batch.reqs if r.rank == m.rank]
                m.prefix_cache.after_step(mine, batch.is_extend)
        return Launched(batch, sampled, step)

    def _resolve(self) -> bool:
        """Read the step in flight (blocks until the device finished it): accept its tokens, stop checks,
        streaming, the role's after_step. Returns False when nothing was in flight."""
        done = self._in_flight
        if done is None:
            return False
        # Cleared only once read: a failure while reading leaves it for _step_failed to rewind.
        if done.batch.mode is ForwardMode.TARGET_VERIFY:
            assert self.spec is not None and done.accepted is not None
            accepted = np.asarray(done.accepted)  # one transfer: counts, drafts and (all greedy) tokens
            self.spec.process_verify(done.batch, accepted, None if done.sampled is None else done.sampled.get())
        else:
            sampled = None if done.sampled is None else done.sampled.get()
            if self.spec is not None and done.step is not None and done.batch.is_extend:
                self.spec.after_extend(done.batch, done.step, sampled)  # before a PD prefill hands it over
            self.output.process_sampled(done.batch, sampled)
            if self.spec is not None and done.step is not None and not done.batch.is_extend:
                self.spec.after_decode(done.batch, done.step)
        self._in_flight = None
        self.role.after_step(done.batch)  # PD prefill: stream the KV computed in this step
        return True

    # ---- what roles call (scheduler thread) ----------------------------------------------------
    def requests(self) -> Iterator[Request]:
        """The waiting, then the running requests (a snapshot: finishing them while iterating is fine)."""
        return iter([*self.waiting, *self.running])

    def admit_with_state(self, r: Request, num_tokens: int, write: Callable[[list[int], int], None]) -> bool:
        """Admit r with its first num_tokens tokens computed elsewhere (PD decode): see
        SchedulePolicy.admit_with_state. False when no rank has room now; write's exception propagates."""
        return self.policy.admit_with_state(r, num_tokens, write)

    def accept_token(self, r: Request, tok: int, lp: float, top_lp: Any, top_ids: Any) -> None:
        """Accept a token sampled elsewhere (PD decode: the prefill server's first token), with stop checks."""
        self.output.accept_token(r, tok, lp, top_lp, top_ids, time.perf_counter())

    def finish(self, r: Request, reason: dict, keep: bool = True) -> None:
        """End r with `reason` (SGLang's finish_reason dict): final text, role hook, memory back, final reply.

        keep=False: do not hand r's computed prefix to the radix cache (a failed step). No-op if finished.
        """
        if r.finished:
            return
        r.finish_reason = reason
        if reason["type"] != "abort":
            r.add_text(r.detokenizer.flush())
        else:  # the text of the tokens so far, ids appended without decoding included, held-back text not
            r.add_text(r.detokenizer.push(()))
        self.role.on_finish(r, reason)  # PD prefill: copy the state out before the memory is freed
        self.policy.release(r, keep)
        if r.grammar is not None:
            r.grammar.release()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if self.metrics:
            self.metrics.on_request_finish(len(r.prompt_ids), len(r.output_ids), time.perf_counter() - r.created,
                                           aborted=reason["type"] == "abort")
        r.sink(r.reply())
