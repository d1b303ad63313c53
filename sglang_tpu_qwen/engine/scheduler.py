"""Scheduler: the thread that runs continuous batching over the paged KV pool and the GDN slot pool.

Each loop iteration drains the inbox (new requests, aborts, cache flushes), then runs one `step`:
the policy (schedule_policy.py) admits waiting requests and picks an extend step (prefill chunks) or a
decode step (one token per decoding request), `ScheduleBatch.build` (schedule_batch.py) lays out its host
arrays, the model runner runs it, and the output processor (output_processor.py) applies the results:
prompt logprobs, sampled tokens, stop checks, streaming. `finish` ends a request: final reply, memory back.

With --dp-size N (data-parallel attention) each DP rank has its own pages, slots and radix tree
(rank_memory.py); a step runs every rank at once, rank r's rows being rows [r*B/N, (r+1)*B/N).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

from sglang_tpu_qwen.engine.metrics import Metrics
from sglang_tpu_qwen.engine.model_runner import ModelRunner
from sglang_tpu_qwen.engine.output_processor import OutputProcessor
from sglang_tpu_qwen.engine.rank_memory import RankMemory
from sglang_tpu_qwen.engine.request import Request
from sglang_tpu_qwen.engine.schedule_batch import ForwardMode, ScheduleBatch
from sglang_tpu_qwen.engine.schedule_policy import SchedulePolicy
from sglang_tpu_qwen.server_args import ServerArgs
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_CHECK = os.environ.get("SGLANG_TPU_QWEN_CHECK_INVARIANTS") == "1"  # debug: verify memory ownership each step


class Scheduler:
    """Runs the batching loop in a background thread; other threads talk to it through `submit`/`abort`."""

    def __init__(
        self, runner: ModelRunner, tokenizer: Tokenizer, args: ServerArgs, context_length: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.args = args
        self.context_length = context_length
        self.metrics = metrics
        self.page_size = runner.page_size
        self.policy = SchedulePolicy(runner, args)
        self.eos_ids = set(runner.config.eos_token_id) | set(tokenizer.eos_token_ids)
        self.output = OutputProcessor(runner, tokenizer, args, context_length, self.eos_ids, metrics, self.finish)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self.disagg: Any = None  # prefill/decode disaggregation role (disagg/roles.py sets it), hooks below
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

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

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    def submit(self, reqs: list[Request]) -> None:
        self._inbox.put(("add", reqs))
        self._wakeup.set()

    def abort(self, rid: str | None) -> None:
        self._inbox.put(("abort", rid))
        self._wakeup.set()

    def flush_cache(self, timeout: float = 60.0) -> bool:
        """Empty the prefix cache if no request is waiting or running (done on the scheduler thread)."""
        done = threading.Event()
        result: list[bool] = []
        self._inbox.put(("flush", (done, result)))
        self._wakeup.set()
        done.wait(timeout)
        return bool(result and result[0])

    @property
    def kv_tokens_total(self) -> int:
        """KV tokens one request can use at most (one rank's pool)."""
        return self.ranks[0].kv_pool.num_usable * self.page_size

    def memory_usage(self) -> dict[str, Any]:
        """Pool usage summed over DP ranks (and per rank under "dp_ranks" when dp > 1). KV pages held by the
        prefix cache are not free until evicted or flushed."""
        per_rank = [self._rank_usage(m) for m in self.ranks]
        if len(per_rank) == 1:
            return per_rank[0]
        usage: dict[str, Any] = {k: sum(u[k] for u in per_rank) for k, v in per_rank[0].items()
                                 if isinstance(v, int) and not isinstance(v, bool) and k != "page_size"}
        usage.update(page_size=self.page_size, radix_cache=per_rank[0]["radix_cache"], dp_ranks=per_rank)
        if "cache_query_tokens" in usage:
            queries = usage["cache_query_tokens"]
            usage["cache_hit_rate"] = usage["cache_hit_tokens"] / queries if queries else 0.0
        return usage

    def _rank_usage(self, m: RankMemory) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "kv_pages_total": m.kv_pool.num_usable,
            "kv_pages_free": m.kv_pool.num_free,
            "gdn_slots_total": m.slot_pool.num_usable,
            "gdn_slots_free": m.slot_pool.num_free,
            "page_size": self.page_size,
            "radix_cache": m.prefix_cache is not None,
        }
        if m.prefix_cache is not None:
            usage.update(m.prefix_cache.stats())
        return usage

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.waiting and not self.running and not (self.disagg is not None and self.disagg.busy):
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                if not self.step():  # nothing runnable right now: do not spin
                    self._wakeup.wait(timeout=0.01)
                    self._wakeup.clear()
            except Exception:  # a failed step must not take the server down with it
                logger.exception("step failed; aborting the running requests")
                for r in list(self.running):
                    self.finish(r, {"type": "abort", "message": "internal error during the step"}, keep=False)
            self._report_usage()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.waiting.extend(payload if self.disagg is None else self.disagg.intercept(payload))
            elif kind == "abort":
                self._abort(payload)
            elif kind == "flush":
                done, result = payload
                idle = not self.waiting and not self.running
                for m in self.ranks:
                    if idle and m.prefix_cache is not None:
                        m.prefix_cache.flush()
                result.append(idle)
                done.set()

    def _abort(self, rid: str | None) -> None:
        """Abort the request `rid` (all its samples), or every request when rid is None."""
        if self.disagg is not None:
            self.disagg.abort(rid)
        for r in [*self.waiting, *self.running]:
            if rid is None or r.rid == rid or r.rid.startswith(rid + "::"):
                self.finish(r, {"type": "abort", "message": "aborted by the client"})

    def step(self) -> bool:
        """Admit, pick one batch, run it. Returns False when there was nothing runnable."""
        if self.disagg is not None:
            self.disagg.poll()  # PD: admit requests whose state arrived, fail broken transfers
        for r in [r for r in self.running if r.aborted]:
            self.finish(r, {"type": "abort", "message": "aborted by the client"})
        self.policy.admit(self.finish)
        mode, chosen = self.policy.pick()
        if mode is ForwardMode.IDLE:
            return False
        if _CHECK:
            self.check_memory_invariants()
        batch = ScheduleBatch.build(mode, chosen, self.runner.buckets, self.eos_ids, self.runner.config.vocab_size)
        self.run_batch(batch)
        return True

    def run_batch(self, batch: ScheduleBatch) -> None:
        """Forward, prompt logprobs, advance cached_len, sample, accept; then the PD and prefix-cache hooks."""
        hidden = self.runner.forward(batch.tokens, batch.prefix_lens, batch.new_lens, batch.page_table,
                                     batch.slot_ids)
        self.output.input_logprobs(batch, hidden)
        for r, n in zip(batch.reqs, batch.extend_lens, strict=True):
            r.cached_len += n
        sampled = None if batch.sampling is None else self.runner.sample(hidden, batch.sampling).get()
        self.output.process_sampled(batch, sampled)
        if self.disagg is not None:
            self.disagg.after_step(batch.chosen)  # PD prefill: stream the KV computed in this step
        for m in self.ranks:
            if m.prefix_cache is not None:
                m.prefix_cache.after_step([r for r in batch.reqs if r.rank == m.rank], batch.is_extend)

    def check_memory_invariants(self) -> None:
        """See SchedulePolicy.check_memory_invariants (AssertionError on a leak or a double owner)."""
        self.policy.check_memory_invariants()

    def choose_rank(self, pages_needed: int, prefix_of: Request | None = None) -> RankMemory | None:
        """See SchedulePolicy.choose_rank."""
        return self.policy.choose_rank(pages_needed, prefix_of)

    # ---- finishing -----------------------------------------------------------------------------
    def finish(self, r: Request, reason: dict, keep: bool = True) -> None:
        """End r with `reason` (SGLang's finish_reason dict): final text, PD hook, memory back, final reply.

        keep=False: do not hand r's computed prefix to the radix cache (a failed step). No-op if finished.
        """
        if r.finished:
            return
        r.finish_reason = reason
        if reason["type"] != "abort" and not r.detokenizer.stopped:
            r.text += r.detokenizer.flush()
        if self.disagg is not None:
            self.disagg.on_finish(r, reason)  # PD prefill: copy the state out before the memory is freed
        self.policy.release(r, keep)
        if r.grammar is not None:
            r.grammar.release()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if self.metrics:
            self.metrics.on_request_finish(len(r.prompt_ids), len(r.output_ids), time.perf_counter() - r.created)
        r.sink(r.reply())

    def _report_usage(self) -> None:
        if self.metrics:
            pages_total = sum(m.kv_pool.num_usable for m in self.ranks)
            slots_total = sum(m.slot_pool.num_usable for m in self.ranks)
            self.metrics.set_usage(
                len(self.running), len(self.waiting),
                pages_total - sum(m.kv_pool.num_free for m in self.ranks), pages_total,
                slots_total - sum(m.slot_pool.num_free for m in self.ranks), slots_total)
