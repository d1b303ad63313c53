"""SchedulePolicy: which requests run next, on which DP rank, with which memory (SGLang's schedule_policy.py).

It owns the waiting queue and the running list and every page and slot decision:
- admission: a waiting request joins when a rank has a running slot and the pages of its first prefill
  chunk (free or evictable); with the radix cache and --schedule-policy lpm the queue is ordered longest
  cached prefix first; a request waits until its grammar is compiled;
- rank choice (--dp-size): the rank holding the longest cached prefix, else the least loaded;
- extend or decode: extend steps take priority (SGLang's scheduler: a prefill batch runs whenever there is
  one, decode otherwise), so admitted prompts reach the decode batch together and decode steps run full;
  a burst of prompts pauses the decodes for its prefill steps (as in SGLang; PD disaggregation is the
  remedy); each rank has its own prefill-token budget;
- pages: each picked request gets the pages of its new tokens; when a rank runs out, its newest request is
  retracted (memory freed, back to the front of the queue, later re-prefilled from prompt + output), so
  memory pressure never crashes the server.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.runner.buckets import BucketSet
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
from sglang_tpu_qwen.engine.scheduler.rank_memory import RankMemory
from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch
from sglang_tpu_qwen.model.forward_batch import ForwardMode

logger = logging.getLogger("sglang_tpu_qwen.engine.scheduler.scheduler")  # one logger for the scheduler's decisions

Finish = Callable[[Request, dict], None]


class SchedulePolicy:
    """Waiting queue, running list and the per-rank memory of one scheduler (see the module docstring)."""

    def __init__(self, runner: ModelRunner, args: ServerArgs, context_length: int) -> None:
        self.runner = runner
        self.args = args
        self.context_length = context_length
        self.page_size = runner.sizing.page_size
        self.ranks = [RankMemory.build(runner, args, rank) for rank in range(runner.sizing.dp)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_counter = 0

    # ---- admission -----------------------------------------------------------------------------
    def peek(self, r: Request) -> int:
        """Longest cached prefix of r on any rank (0 without the radix cache)."""
        return max((m.prefix_cache.peek(r) for m in self.ranks if m.prefix_cache is not None), default=0)

    def admit(self, finish: Finish) -> None:
        """Move waiting requests to running while a rank has room; `finish` ends those whose grammar failed."""
        if not self.args.disable_radix_cache and self.args.schedule_policy == "lpm" and 1 < len(self.waiting) <= 128:
            # Longest prefix first (SGLang's lpm): requests sharing a cached prefix run while it is hot.
            ordered = sorted(self.waiting, key=self.peek, reverse=True)
            self.waiting.clear()
            self.waiting.extend(ordered)
        while self.waiting and len(self.running) < self.args.max_running_requests:
            r = self._next_admissible(finish)
            if r is None:
                return
            m = self._choose_rank_for(r)
            if m is None:
                return
            slot = m.slot_pool.alloc(1)
            assert slot is not None  # choose_rank checked
            self.waiting.remove(r)
            r.rank = m.rank
            r.slot = slot[0]
            if m.prefix_cache is not None:
                m.prefix_cache.admit(r)
            self.add_running(r)

    def add_running(self, r: Request) -> None:
        """r (holding its rank's slot and pages) joins the running list as the newest request."""
        self._admit_counter += 1
        r.admit_order = self._admit_counter
        self.running.append(r)

    def _next_admissible(self, finish: Finish) -> Request | None:
        """The first waiting request whose grammar (if any) is compiled; the batch never waits for a compile.

        A request whose grammar failed to compile is finished with the compiler's message.
        """
        for r in list(self.waiting):
            if r.tokens_in_flight or r.verify_fed:  # retracted while its tokens were on the device: wait for them
                continue
            try:
                if r.grammar is None or r.grammar.ready():
                    return r
            except InvalidRequestError as e:
                finish(r, {"type": "abort", "message": str(e)})
        return None

    def _choose_rank_for(self, r: Request) -> RankMemory | None:
        """The rank to admit r to (see choose_rank), needing pages for r's first prefill chunk."""
        first_chunk = min(r.pending, self.args.chunked_prefill_per_rank)
        return self.choose_rank(self.pages_needed(r, r.cached_len + first_chunk), r)

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

    def admit_with_state(self, r: Request, num_tokens: int, write: Callable[[list[int], int], None]) -> bool:
        """Admit r whose first num_tokens tokens were computed elsewhere (PD decode): pages for num_tokens + 1
        tokens and a slot on the rank choose_rank picks, `write(pages, slot)` fills them, r joins running
        with cached_len = num_tokens. False (nothing taken) when no rank has room now; if write raises, the
        memory goes back and the exception propagates."""
        if len(self.running) >= self.args.max_running_requests:
            return False
        need = math.ceil((num_tokens + 1) / self.page_size)
        m = self.choose_rank(need)
        if m is None:
            return False
        short = need - m.kv_pool.num_free
        if short > 0 and m.prefix_cache is not None:
            m.prefix_cache.evict_pages(short)
        pages = m.kv_pool.alloc(need)
        if pages is None:
            return False
        slot = m.slot_pool.alloc(1)
        assert slot is not None  # choose_rank checked
        try:
            write(pages, slot[0])
        except BaseException:  # never keep the memory of a request that cannot start
            m.kv_pool.free(pages)
            m.slot_pool.free(slot)
            raise
        r.rank, r.slot, r.pages = m.rank, slot[0], pages
        r.num_tree_pages = 0
        r.cached_len = num_tokens
        self.add_running(r)
        return True

    # ---- picking a step ------------------------------------------------------------------------
    def pick(self) -> PickedBatch:
        """The next step's batch (its requests' pages allocated): an extend step when a prompt has tokens
        left, else a decode step; PickedBatch.idle() when nothing can run."""
        picked = self._pick_extend() if self._want_extend() else None
        if not picked:
            picked = self._pick_decode()
        return picked if picked else PickedBatch.idle()

    def _want_extend(self) -> bool:
        return any(r.pending > 1 for r in self.running)

    def _pick_extend(self) -> PickedBatch:
        """Prefill chunks for this step (:func:`extend_chunks`), each request's pages allocated (retracting
        newer requests where a rank runs out)."""
        def target(r: Request) -> int | None:
            cache = self.ranks[r.rank].prefix_cache
            return cache.next_target(r) if cache is not None else None

        best = extend_chunks(self.running, self.runner.buckets, self.args, len(self.ranks), target)
        reqs, lens = [], []
        for r, n in zip(best.reqs, best.extend_lens, strict=True):
            if r.slot is None:  # retracted by an earlier candidate's page allocation
                continue
            # The chunk that ends a prompt also holds the MTP layer's first drafts (speculative decoding).
            ahead = self.runner.spec_steps if n == r.pending else 0
            cap = min(self.context_length, self.runner.buckets.pages * self.page_size)
            if self._ensure_pages_or_retract(r, max(r.cached_len + n, min(r.cached_len + n + ahead, cap))):
                reqs.append(r)
                lens.append(n)
        return PickedBatch(ForwardMode.EXTEND, reqs, lens)

    def _pick_decode(self) -> PickedBatch:
        """One token for every decoding request, at most the largest decode bucket's rows per rank."""
        reqs: list[Request] = []
        rows = [0] * len(self.ranks)
        max_rows = self.runner.buckets.max_decode_rows
        for r in sorted((r for r in self.running if r.pending == 1), key=lambda r: r.admit_order):
            if r.slot is None or rows[r.rank] >= max_rows:
                continue
            if r.tokens_in_flight and (r.num_output >= r.max_new_tokens
                                       or len(r.fill_ids) + r.tokens_in_flight >= self.context_length):
                continue  # its token in flight is its last: it finishes when that token is read
            if r.verify_fed and (len(r.output_ids) + 1 >= r.max_new_tokens
                                 or len(r.fill_ids) + 1 >= self.context_length):
                continue  # its verify step in flight yields at least one token, its last
            rows[r.rank] += 1
            if self._ensure_pages_or_retract(r, self._decode_tokens(r)):
                reqs.append(r)
        return PickedBatch(ForwardMode.DECODE, reqs, [1] * len(reqs))

    def _decode_tokens(self, r: Request) -> int:
        """Tokens r's next decode step needs pages for: one, or with speculative decoding its verify step and
        the drafts after it (engine/scheduler/speculative.py), within the context and the page table."""
        steps = self.runner.spec_steps
        if not steps:
            return r.cached_len + 1
        cap = min(self.context_length, self.runner.buckets.pages * self.page_size)
        # Its verify step in flight may accept all it fed (r.verify_fed), then 1 + k tokens and k - 1 drafts.
        return max(r.cached_len + 1, min(r.cached_len + r.verify_fed + 2 * steps + 1, cap))

    # ---- memory --------------------------------------------------------------------------------
    def pages_needed(self, r: Request, num_tokens: int) -> int:
        """Pages r must still get to hold num_tokens tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(r.pages))

    def _ensure_pages_or_retract(self, r: Request, num_tokens: int) -> bool:
        """Give r pages for num_tokens tokens, retracting newer requests if needed; False if r was retracted."""
        need = self.pages_needed(r, num_tokens)  # fixed below: retracting others does not change r's pages
        if not need:  # most decode steps: the token fits r's last page
            return True
        m = self.ranks[r.rank]
        while True:
            short = need - m.kv_pool.num_free
            if short > 0 and m.prefix_cache is not None:
                m.prefix_cache.evict_pages(short)
            got = m.kv_pool.alloc(need)
            if got is not None:
                r.pages.extend(got)
                return True
            # Only requests of the same rank hold pages this rank can reuse.
            newer = [x for x in self.running
                     if x.rank == r.rank and x.admit_order > r.admit_order and x.slot is not None]
            victim = max(newer, key=lambda x: x.admit_order) if newer else r
            self.retract(victim)
            if victim is r:
                return False

    def release(self, r: Request, keep: bool = True) -> None:
        """Return r's memory; with the prefix cache, first hand what r computed to the tree (keep=True)."""
        m = self.ranks[r.rank]
        keep = keep and r.cached_len <= len(r.fill_ids)  # state of a token not read yet is not cacheable
        if m.prefix_cache is not None:
            m.prefix_cache.finish(r, keep)
        if r.pages:
            m.kv_pool.free(r.pages)
            r.pages = []
        if r.slot is not None:
            m.slot_pool.free([r.slot])
            if self.args.debug_nan_fill_freed_slots:
                self.runner.state.fill_nan_slots([r.slot])
            r.slot = None
        r.cached_len = 0

    def retract(self, r: Request) -> None:
        """Free r's memory and put it back at the front of the queue (it re-prefills prompt + output)."""
        logger.info("retracting request %s (%d tokens) to free KV pages", r.rid, len(r.fill_ids))
        self.release(r)
        if not r.input_logprobs_done:  # the re-prefill computes them again from the start
            r.input_token_logprobs.clear()
            r.input_top_logprobs.clear()
        self.running.remove(r)
        self.waiting.appendleft(r)

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


def extend_chunks(running: Iterable[Request], buckets: BucketSet, args: ServerArgs, num_ranks: int,
                  next_target: Callable[[Request], int | None]) -> PickedBatch:
    """The prefill chunks of the next extend step, shaped to fit a compiled bucket (engine/runner/buckets.py),
    before any page is allocated: ``SchedulePolicy._pick_extend``'s choice, and the prefill benchmark's
    (bench/prefill_step.py), which lays out the steps of prompts without running the scheduler.

    Args:
        running: the running requests; those with more than one pending token (``Request.pending``) prefill,
            in admission order (``admit_order``).
        buckets: the runner's BucketSet; args: the server flags (``chunked_prefill_per_rank`` and
            ``max_prefill_tokens`` bound a rank's prompt tokens per step, as SGLang's PrefillAdder).
        num_ranks: DP ranks (``Request.rank`` < num_ranks).
        next_target: the position past a request's ``cached_len`` where its chunk must end for a GDN snapshot
            (the prefix cache's ``next_target``), None for none.
    Returns:
        An EXTEND PickedBatch (no requests when none prefills): for each extend token size t, the requests in
        admission order take min(their chunk, t) tokens each, at most the bucket's rows for t and the step's
        token budget per rank; the size whose step feeds the most prompt tokens wins (ties: fewer rows). Every
        full extend bucket holds the same number of token slots (rows x t), and its forward costs about the same
        (measured on the 2-core CPU: 22-24 ms for (32, 16) ... (4, 128) on the held-out model; 20-24 ms for (32,
        16) ... (1, 512) on the embedded one), so the fullest step is the cheapest per token. Taking rows first
        and capping chunks afterwards left a third of the slots empty when chunks end at snapshot pages (many
        chunks just under a bucket's width).
    """
    step_budget = min(args.chunked_prefill_per_rank, args.max_prefill_tokens)
    # Each prompt's whole next chunk, before the bucket and budget caps.
    wanted: list[Request] = []
    wanted_lens: list[int] = []
    for r in sorted((r for r in running if r.pending > 1), key=lambda r: r.admit_order):
        n = r.pending
        target = next_target(r)
        if target is not None:  # end the chunk where a snapshot is wanted
            n = min(n, target - r.cached_len)
        wanted.append(r)
        wanted_lens.append(n)
    best = PickedBatch(ForwardMode.EXTEND, [], [])
    best_key = (0, 0)
    for t in buckets.token_sizes:
        limit = buckets.extend_batches(t)[-1]
        budget = [step_budget] * num_ranks
        rows = [0] * num_ranks
        reqs: list[Request] = []
        lens: list[int] = []
        for r, n in zip(wanted, wanted_lens, strict=True):
            if budget[r.rank] <= 0 or rows[r.rank] >= limit:
                continue
            k = min(n, t, budget[r.rank])
            reqs.append(r)
            lens.append(k)
            budget[r.rank] -= k
            rows[r.rank] += 1
        key = (sum(lens), -len(reqs))
        if key > best_key:
            best, best_key = PickedBatch(ForwardMode.EXTEND, reqs, lens), key
    return best
