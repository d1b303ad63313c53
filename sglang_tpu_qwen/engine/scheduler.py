"""Scheduler: continuous batching over the paged KV pool and the GDN slot pool.

Each step is either an extend step (prefill chunks of one or more requests, at most
--chunked-prefill-size new tokens) or a decode step (one token for every request that is decoding).
Extend steps take priority, but never twice in a row while requests are decoding, so a stream of
long prompts cannot stall the decodes. A request joins when a GDN slot and the pages of its first
chunk are free; when a decode cannot get a page, the newest request is retracted (its pages and slot
freed) and later re-prefilled from prompt + output, so memory pressure never crashes the server.

With --dp-size N (data-parallel attention) each DP rank has its own pages, slots and radix tree
(rank_memory.py); a request is admitted to the rank holding the longest cached prefix of it, else the
least loaded one. A step runs every rank at once: rank r's rows are rows [r*B/N, (r+1)*B/N) of the
batch, and each rank has its own prefill-token budget.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from sglang_tpu_qwen.engine.errors import InvalidRequestError
from sglang_tpu_qwen.engine.faults import FaultInjector
from sglang_tpu_qwen.engine.health import HealthSnapshot, HealthState
from sglang_tpu_qwen.engine.metrics import Metrics
from sglang_tpu_qwen.engine.model_runner import ModelRunner, SamplingBatch, next_pow2
from sglang_tpu_qwen.engine.rank_memory import RankMemory
from sglang_tpu_qwen.engine.request import Request
from sglang_tpu_qwen.engine.step_failures import StepFailures
from sglang_tpu_qwen.grammar.bitmask import token_bitmask
from sglang_tpu_qwen.memory import gdn_state
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
        self.ranks = [RankMemory.build(runner, args, rank) for rank in range(runner.dp)]
        self.eos_ids = set(runner.config.eos_token_id) | set(tokenizer.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._last_was_extend = False
        self._admit_counter = 0
        self.disagg: Any = None  # prefill/decode disaggregation role (disagg/roles.py sets it), hooks below
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.health_state = HealthState()  # engine/health.py: what /health reports
        self.faults = FaultInjector.from_env()  # engine/faults.py: test-only fault points
        self.failures = StepFailures(self, self.health_state)  # engine/step_failures.py

    # ---- other threads -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    def health(self) -> HealthSnapshot:
        """A consistent snapshot of the scheduler's health (engine/health.py)."""
        return self.health_state.snapshot(alive=self._thread.is_alive())

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
        """Run until shutdown. Every failure is handled by StepFailures (engine/step_failures.py): a step's
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
        self.faults.check("loop", [r.rid for r in self.waiting])
        if self.health_state.fatal_error is not None:
            self.failures.fail_all(f"Internal server error: {self.health_state.fatal_error}")
        if not self.waiting and not self.running and not (self.disagg is not None and self.disagg.busy):
            self._wakeup.wait(timeout=0.5)
            self._wakeup.clear()
            return
        self._batch: list[tuple[Request, int]] = []
        try:
            if not self.step():  # nothing runnable right now: do not spin
                self._wakeup.wait(timeout=0.01)
                self._wakeup.clear()
            else:
                self.failures.step_passed(self._batch)
        except Exception as e:  # a failed step must not take the server down with it
            self.failures.step_failed(self._batch, e)
        finally:
            self.health_state.step_ends()
        self._report_usage()
        self.failures.loop_passed()

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
                self._finish(r, {"type": "abort", "message": "aborted by the client"})

    def step(self) -> bool:
        """Admit, pick one batch, run it. Returns False when there was nothing runnable."""
        if self.disagg is not None:
            self.disagg.poll()  # PD: admit requests whose state arrived, fail broken transfers
        self._drop_aborted()
        self._admit()
        chosen = self._pick_extend() if self._want_extend() else []
        is_extend = bool(chosen)
        if not chosen:
            chosen = self._pick_decode()
        if not chosen:
            return False
        chosen = self.failures.isolate(chosen)  # a suspect of a failed step runs alone
        self._batch = chosen
        self.health_state.step_begins()
        self._last_was_extend = is_extend
        if _CHECK:
            self.check_memory_invariants()
        self._run(chosen, is_extend)
        return True

    def check_memory_invariants(self) -> None:
        """Every page and slot is held by exactly one owner (pool, tree, request) of the request's own DP
        rank; raises AssertionError."""
        for m in self.ranks:
            self._check_rank(m)

    def _check_rank(self, m: RankMemory) -> None:
        owned: dict[int, str] = {}
        tree = m.prefix_cache.tree if m.prefix_cache is not None else None
        tree_pages = set(tree._pages) if tree is not None else set()
        pages_lo, pages_hi = m.kv_pool.start, m.kv_pool.size
        running = [r for r in self.running if r.rank == m.rank]
        for r in running:
            assert r.slot is not None and m.slot_pool.start <= r.slot < m.slot_pool.size, f"{r.rid}: slot {r.slot}"
            for i, p in enumerate(r.pages):
                assert pages_lo <= p < pages_hi, f"{r.rid}: page {p} is not rank {m.rank}'s"
                if i < r.num_tree_pages:
                    assert p in tree_pages, f"{r.rid}: page {p} at {i} should be the tree's"
                    continue
                assert p not in tree_pages, f"{r.rid}: own page {p} at {i} is also the tree's"
                assert p not in owned, f"page {p} held by {r.rid} and {owned[p]}"
                owned[p] = r.rid
        free = set(m.kv_pool._free)
        assert not (free & set(owned)) and not (free & tree_pages), "a free page is in use"
        assert len(free) + len(owned) + len(tree_pages) == m.kv_pool.num_usable, "pages leaked"
        slots = [r.slot for r in running]
        assert len(slots) == len(set(slots)) and None not in slots, f"slots {slots}"

    def _drop_aborted(self) -> None:
        for r in [r for r in self.running if r.aborted]:
            self._finish(r, {"type": "abort", "message": "aborted by the client"})

    def _peek(self, r: Request) -> int:
        """Longest cached prefix of r on any rank (0 without the radix cache)."""
        return max((m.prefix_cache.peek(r) for m in self.ranks if m.prefix_cache is not None), default=0)

    def _admit(self) -> None:
        if not self.args.disable_radix_cache and self.args.schedule_policy == "lpm" and 1 < len(self.waiting) <= 128:
            # Longest prefix first (SGLang's lpm): requests sharing a cached prefix run while it is hot.
            self.waiting = deque(sorted(self.waiting, key=self._peek, reverse=True))
        while self.waiting and len(self.running) < self.args.max_running_requests:
            r = self._next_admissible()
            if r is None:
                return
            m = self._choose_rank(r)
            if m is None:
                return
            slot = m.slot_pool.alloc(1)
            assert slot is not None  # _choose_rank checked
            self.waiting.remove(r)
            r.rank = m.rank
            r.slot = slot[0]
            if m.prefix_cache is not None:
                m.prefix_cache.admit(r)
            self._admit_counter += 1
            r.admit_order = self._admit_counter
            self.running.append(r)

    def _next_admissible(self) -> Request | None:
        """The first waiting request whose grammar (if any) is compiled; the batch never waits for a compile.

        A request whose grammar failed to compile is finished with the compiler's message.
        """
        for r in list(self.waiting):
            try:
                if r.grammar is None or r.grammar.ready():
                    return r
            except InvalidRequestError as e:
                self._finish(r, {"type": "abort", "message": str(e)})
        return None

    def _choose_rank(self, r: Request) -> RankMemory | None:
        """The rank to admit r to (see choose_rank), needing pages for r's first prefill chunk."""
        first_chunk = min(r.pending, self.args.chunked_prefill_size)
        return self.choose_rank(self._pages_needed(r, r.cached_len + first_chunk), r)

    def choose_rank(self, pages_needed: int, prefix_of: Request | None = None) -> RankMemory | None:
        """Among ranks with a free running slot and `pages_needed` pages (free or evictable), the one with the
        longest cached prefix of `prefix_of` (if given), then the fewest running requests, then the most
        free pages; None when no rank has room now. Also used by PD decode admission (disagg/decode.py)."""
        running = [0] * len(self.ranks)
        for x in self.running:
            running[x.rank] += 1
        best, best_key = None, None
        for m in self.ranks:
            cache = m.prefix_cache
            available = m.kv_pool.num_free + (cache.evictable_pages if cache is not None else 0)
            if running[m.rank] >= m.max_running or m.slot_pool.num_free == 0 or pages_needed > available:
                continue
            hit = cache.peek(prefix_of) if prefix_of is not None and cache is not None and len(self.ranks) > 1 else 0
            key = (hit, -running[m.rank], m.kv_pool.num_free)
            if best_key is None or key > best_key:
                best, best_key = m, key
        return best

    def _want_extend(self) -> bool:
        has_extend = any(r.pending > 1 for r in self.running)
        has_decode = any(r.pending == 1 for r in self.running)
        return has_extend and (not has_decode or not self._last_was_extend)

    def _pick_extend(self) -> list[tuple[Request, int]]:
        # Prompt tokens per rank per step: --chunked-prefill-size and --max-prefill-tokens both bound the step's
        # total, as SGLang's PrefillAdder (rem_chunk_tokens, rem_input_tokens).
        budget = [min(self.args.chunked_prefill_size, self.args.max_prefill_tokens)] * len(self.ranks)
        chosen: list[tuple[Request, int]] = []
        for r in sorted((r for r in self.running if r.pending > 1), key=lambda r: r.admit_order):
            if r.slot is None or budget[r.rank] <= 0:  # retracted earlier in this loop, or rank full
                continue
            n = min(r.pending, budget[r.rank])
            cache = self.ranks[r.rank].prefix_cache
            target = cache.next_target(r) if cache is not None else None
            if target is not None:  # end the chunk where a snapshot is wanted
                n = min(n, target - r.cached_len)
            if not self._ensure_pages_or_retract(r, r.cached_len + n):
                continue
            chosen.append((r, n))
            budget[r.rank] -= n
        return chosen

    def _pick_decode(self) -> list[tuple[Request, int]]:
        chosen: list[tuple[Request, int]] = []
        for r in sorted((r for r in self.running if r.pending == 1), key=lambda r: r.admit_order):
            if r.slot is None:
                continue
            if self._ensure_pages_or_retract(r, r.cached_len + 1):
                chosen.append((r, 1))
        return chosen

    # ---- memory --------------------------------------------------------------------------------
    def _pages_needed(self, r: Request, num_tokens: int) -> int:
        return max(0, math.ceil(num_tokens / self.page_size) - len(r.pages))

    def _ensure_pages_or_retract(self, r: Request, num_tokens: int) -> bool:
        """Give r pages for num_tokens tokens, retracting newer requests if needed; False if r was retracted."""
        m = self.ranks[r.rank]
        while True:
            need = self._pages_needed(r, num_tokens)
            short = need - m.kv_pool.num_free
            if short > 0 and m.prefix_cache is not None:
                m.prefix_cache.evict_pages(short)
            got = m.kv_pool.alloc(need) if need else []
            if got is not None:
                r.pages.extend(got)
                return True
            # Only requests of the same rank hold pages this rank can reuse.
            newer = [x for x in self.running
                     if x.rank == r.rank and x.admit_order > r.admit_order and x.slot is not None]
            victim = max(newer, key=lambda x: x.admit_order) if newer else r
            self._retract(victim)
            if victim is r:
                return False

    def _release(self, r: Request, keep: bool = True) -> None:
        """Return r's memory; with the prefix cache, first hand what r computed to the tree (keep=True)."""
        m = self.ranks[r.rank]
        if m.prefix_cache is not None:
            m.prefix_cache.finish(r, keep)
        if r.pages:
            m.kv_pool.free(r.pages)
            r.pages = []
        if r.slot is not None:
            m.slot_pool.free([r.slot])
            if self.args.debug_nan_fill_freed_slots:
                self.runner.cache = gdn_state.fill_nan(self.runner.cache, [r.slot])
            r.slot = None
        r.cached_len = 0

    def _retract(self, r: Request) -> None:
        logger.info("retracting request %s (%d tokens) to free KV pages", r.rid, len(r.fill_ids))
        self._release(r)
        if not r.input_logprobs_done:  # the re-prefill computes them again from the start
            r.input_token_logprobs.clear()
            r.input_top_logprobs.clear()
        self.running.remove(r)
        self.waiting.appendleft(r)

    # ---- running a batch -----------------------------------------------------------------------
    def _batch_rows(self, chosen: list[tuple[Request, int]]) -> tuple[list[int], int]:
        """Batch row of each chosen request and the batch size B: rank r's rows are [r*B/dp, (r+1)*B/dp)."""
        dp = len(self.ranks)
        count = [0] * dp
        rows = []
        for r, _ in chosen:
            count[r.rank] += 1
        per_rank = next_pow2(max(count))
        count = [0] * dp
        for r, _ in chosen:
            rows.append(r.rank * per_rank + count[r.rank])
            count[r.rank] += 1
        return rows, per_rank * dp

    def _run(self, chosen: list[tuple[Request, int]], is_extend: bool) -> None:
        rows, b = self._batch_rows(chosen)
        max_new = max(n for _, n in chosen)
        t = next_pow2(max_new, 16) if is_extend else 1
        p = next_pow2(max(len(r.pages) for r, _ in chosen), 4)
        tokens = np.zeros((b, t), np.int32)
        prefix_lens = np.zeros(b, np.int32)
        new_lens = np.zeros(b, np.int32)
        slot_ids = np.zeros(b, np.int32)
        page_table = np.zeros((b, p), np.int32)
        for (r, n), i in zip(chosen, rows, strict=True):
            tokens[i, :n] = r.fill_ids[r.cached_len : r.cached_len + n]
            prefix_lens[i], new_lens[i], slot_ids[i] = r.cached_len, n, r.slot
            page_table[i, : len(r.pages)] = r.pages
        self.faults.check("forward", [r.rid for r, _ in chosen], self.runner)
        hidden = self.runner.forward(tokens, prefix_lens, new_lens, page_table, slot_ids)
        self._input_logprobs(chosen, rows, hidden)

        finishing = [i for i, (r, n) in enumerate(chosen) if r.cached_len + n == len(r.fill_ids)]
        for r, n in chosen:
            r.cached_len += n
        self._sample_and_accept(chosen, rows, finishing, hidden, new_lens, b)
        if self.disagg is not None:
            self.disagg.after_step(chosen)  # PD prefill: stream the KV computed in this step
        for m in self.ranks:
            if m.prefix_cache is not None:
                m.prefix_cache.after_step([r for r, _ in chosen if r.rank == m.rank], is_extend)

    def _sample_and_accept(self, chosen: list[tuple[Request, int]], rows: list[int], finishing: list[int],
                           hidden: Any, new_lens: np.ndarray, b: int) -> None:
        """Sample the next token of every row whose pending tokens are all in the cache now."""
        if all(chosen[i][0].max_new_tokens == 0 for i in finishing):  # scoring only: nothing to sample
            for i in finishing:
                self._finish(chosen[i][0], {"type": "length", "length": 0})
            return
        batch = self._sampling_batch(chosen, rows, b)
        self.faults.check("sampler", [r.rid for r, _ in chosen])
        toks, lps, top_lps, top_ids = self.runner.sample(hidden, np.maximum(new_lens - 1, 0), batch)
        now = time.perf_counter()
        for i in finishing:
            r, row = chosen[i][0], rows[i]
            if r.max_new_tokens == 0:  # scoring only: the prompt's logprobs are the answer
                self._finish(r, {"type": "length", "length": 0})
                continue
            self._accept_token(r, int(toks[row]), float(lps[row]), top_lps[row], top_ids[row], now)

    def _input_logprobs(self, chosen: list[tuple[Request, int]], batch_rows: list[int], hidden: Any) -> None:
        """Prompt logprobs from logprob_start_len, gathered for the positions this step computed."""
        rows, cols, targets, owners = [], [], [], []
        num_top = 0
        for (r, n), i in zip(chosen, batch_rows, strict=True):
            if not r.return_logprob or r.input_logprobs_done:
                continue
            prompt = r.prompt_ids
            if r.cached_len <= r.logprob_start_len == 0 and not r.input_token_logprobs:
                r.input_token_logprobs.append([None, prompt[0], self._tok_text(r, prompt[0])])
                r.input_top_logprobs.append(None)
            # Position j predicts token j + 1; keep targets in [max(start, 1), len(prompt)).
            for j in range(r.cached_len, r.cached_len + n):
                target = j + 1
                if max(r.logprob_start_len, 1) <= target < len(prompt):
                    rows.append(i)
                    cols.append(j - r.cached_len)
                    targets.append(prompt[target])
                    owners.append(r)
            num_top = max(num_top, r.top_logprobs_num)
            if r.cached_len + n >= len(prompt):
                r.input_logprobs_done = True
        if not rows:
            return
        lp, top_lp, top_ids = self.runner.logprobs_at(hidden, np.array(rows), np.array(cols), np.array(targets),
                                                      num_top)
        for k, r in enumerate(owners):
            r.input_token_logprobs.append([float(lp[k]), targets[k], self._tok_text(r, targets[k])])
            if r.top_logprobs_num:
                r.input_top_logprobs.append(self._top_list(r, top_lp[k], top_ids[k]))

    def _sampling_batch(self, chosen: list[tuple[Request, int]], rows: list[int], b: int) -> SamplingBatch:
        temperature = np.zeros(b, np.float32)
        top_p = np.ones(b, np.float32)
        top_k = np.zeros(b, np.int32)
        min_p = np.zeros(b, np.float32)
        seeds = np.zeros(b, np.uint32)
        steps = np.zeros(b, np.int32)
        rep = np.ones(b, np.float32)
        freq = np.zeros(b, np.float32)
        pres = np.zeros(b, np.float32)
        any_penalty = any(r.params.has_penalty for r, _ in chosen)
        seen_ids = output_ids = None
        if any_penalty:
            seen_ids = np.full((b, next_pow2(max(len(r.fill_ids) for r, _ in chosen), 16)), -1, np.int32)
            output_ids = np.full((b, next_pow2(max(len(r.output_ids) for r, _ in chosen), 16)), -1, np.int32)
        ban_lists: list[list[int]] = [[] for _ in range(b)]
        for (r, _), i in zip(chosen, rows, strict=True):
            sp = r.params
            temperature[i] = 0.0 if sp.greedy else sp.temperature
            top_p[i], top_k[i], min_p[i] = sp.top_p, max(sp.top_k, 0), sp.min_p
            seeds[i] = np.uint32(r.seed & 0xFFFFFFFF)
            steps[i] = len(r.output_ids)
            rep[i], freq[i], pres[i] = sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
            if seen_ids is not None and output_ids is not None:
                seen_ids[i, : len(r.fill_ids)] = r.fill_ids
                output_ids[i, : len(r.output_ids)] = r.output_ids
            bans: list[int] = []
            if len(r.output_ids) < sp.min_new_tokens:
                bans = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids))
            ban_lists[i] = bans
        banned = np.full((b, next_pow2(max(len(x) for x in ban_lists), 4)), -1, np.int32)
        for i, bans in enumerate(ban_lists):
            banned[i, : len(bans)] = bans
        want_logprobs = any(r.return_logprob for r, _ in chosen)
        num_top = max((r.top_logprobs_num for r, _ in chosen if r.return_logprob), default=0)
        grammars: list[Any] = [None] * b
        for (r, _), i in zip(chosen, rows, strict=True):
            grammars[i] = r.grammar
        return SamplingBatch(temperature, top_p, top_k, min_p, seeds, steps, rep, freq, pres, seen_ids,
                             output_ids, banned, want_logprobs, num_top,
                             token_bitmask(grammars, b, self.runner.config.vocab_size))

    # ---- outputs -------------------------------------------------------------------------------
    def _tok_text(self, r: Request, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if r.return_text_in_logprobs else None

    def _top_list(self, r: Request, vals: np.ndarray, ids: np.ndarray) -> list[list[Any]]:
        return [[float(v), int(t), self._tok_text(r, int(t))] for v, t in zip(vals, ids, strict=True)]

    def _accept_token(self, r: Request, tok: int, lp: float, top_lp: np.ndarray, top_ids: np.ndarray,
                      now: float) -> None:
        if r.first_token_time is None:
            r.first_token_time = now
            if self.metrics:
                self.metrics.on_first_token(now - r.created)
        elif self.metrics and r.last_token_time is not None:
            self.metrics.on_decode_token(now - r.last_token_time)
        r.last_token_time = now
        r.output_ids.append(tok)
        if r.return_logprob:
            r.output_token_logprobs.append([lp, tok, self._tok_text(r, tok)])
            if r.top_logprobs_num:
                r.output_top_logprobs.append(self._top_list(r, top_lp[: r.top_logprobs_num],
                                                            top_ids[: r.top_logprobs_num]))
        sp = r.params
        r.text += r.detokenizer.push([tok])
        if r.grammar is not None and r.grammar.advance(tok, len(r.output_ids) - 1):
            self._finish(r, r.grammar.end_reason(tok))  # a stop token where the grammar may end
            return
        if tok in sp.stop_ids(self.eos_ids) and len(r.output_ids) >= sp.min_new_tokens:
            self._finish(r, {"type": "stop", "matched": tok})
        elif r.detokenizer.stopped:
            self._finish(r, {"type": "stop", "matched": r.detokenizer.matched_stop})
        elif len(r.output_ids) >= r.max_new_tokens or len(r.fill_ids) >= self.context_length:
            self._finish(r, {"type": "length", "length": len(r.output_ids)})
        elif r.stream and len(r.output_ids) - r.streamed_upto >= self.args.stream_interval:
            r.streamed_upto = len(r.output_ids)
            r.sink(r.reply())

    def _finish(self, r: Request, reason: dict, keep: bool = True) -> None:
        if r.finished:
            return
        r.finish_reason = reason
        if reason["type"] != "abort" and not r.detokenizer.stopped:
            r.text += r.detokenizer.flush()
        if self.disagg is not None:
            self.disagg.on_finish(r, reason)  # PD prefill: copy the state out before the memory is freed
        self._release(r, keep)
        if r.grammar is not None:
            r.grammar.release()
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if self.metrics:
            self.metrics.on_request_finish(len(r.prompt_ids), len(r.output_ids), time.perf_counter() - r.created)
        r.sink(r.reply())

    # The names engine/step_failures.py uses (the split scheduler's public ones).
    finish = _finish
    release = _release

    def _report_usage(self) -> None:
        if self.metrics:
            pages_total = sum(m.kv_pool.num_usable for m in self.ranks)
            slots_total = sum(m.slot_pool.num_usable for m in self.ranks)
            self.metrics.set_usage(
                len(self.running), len(self.waiting),
                pages_total - sum(m.kv_pool.num_free for m in self.ranks), pages_total,
                slots_total - sum(m.slot_pool.num_free for m in self.ranks), slots_total)
