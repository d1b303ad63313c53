"""Speculative decoding with the checkpoint's MTP layer (SGLang's NEXTN / EAGLE with top-k 1): the scheduler side.

A decode step becomes a verify step: each request feeds its last token and the k tokens the MTP layer drafted
(``Request.draft_tokens``, k = --speculative-num-steps) in one target forward (``ForwardMode.TARGET_VERIFY``,
engine/runner/spec_programs.py). Every position is sampled by the ordinary sampling programs (an all-greedy step
by the greedy program's function inside its commit program), row b's position t as the request's output token
``num_output + t`` (its own random stream step, bans, bias and logprobs), and the
request accepts the sampled tokens while each equals the draft fed after it: the first mismatch is the last
token accepted (the target's own token at that position, so a step always yields at least one).

Exact by construction: every accepted token is the token plain decoding samples at that position, from the
same distribution with the same random stream; a draft only decides how many positions one step computes.
Greedy output equals plain greedy decoding; with temperature > 0 the output distribution is plain decoding's.
The acceptance test is "sample the target, then compare"; the MTP drafts are greedy (SGLang's top-k 1), a
one-hot draft distribution q, and for it this is exactly speculative (rejection) sampling (Leviathan et al.,
ICML 2023): draft x is accepted with probability min(1, p(x) / q(x)) = p(x), and on rejection the token comes
from norm(max(p - q, 0)), which is p without x, renormalised: the target's sample given that it is not x.
Position t of a row samples with every sampling feature applied as plain decoding would after the drafts
before it were accepted: penalties count those drafts (sampling_batch's ``drafts``), and a grammar row's mask
at position t is filled ahead over them (RequestGrammar.fill_drafts, which stops the drafts at the first one
the grammar refuses or that ends it, then rolls the matcher back: the accepted tokens advance it afterwards
as plain decoding's do).

GDN state: the verify step leaves the slots as they were; its commit program counts each row's accepted tokens
on the device (the same rule, without the host's stops) and runs the conv1d and delta rule again over exactly
those tokens from the saved layer inputs (model/forward.py ``commit_gdn_states``: recompute from the pre-verify
state). Where an accepted run ends on a page boundary the commit also writes the state to the request's private
decode snapshot slot. A snapshot is therefore always of accepted tokens (sglang #36537); until the host has read
the step the snapshot is pending (``Request.snapshot_pending``), and a request that ends before (abort,
retraction) or inside the run (a stop) leaves it out of the tree. A run that crosses a boundary in its middle
takes no snapshot there; a request whose snapshot so lags the last boundary it passed feeds no draft past the
next one (``_snapshot_lags``; for a carried row the device decides the same from the carry), so its snapshot
lags at most one page. Rejected positions' KV (target and MTP layer)
sits past the request's length and is overwritten by later steps. Then the commit program runs the MTP layer over
the accepted positions (their target hidden states, and the next tokens) and drafts the next k tokens.

Overlap scheduling: the scheduler builds and launches verify step N+1 before it reads step N. Step N's commit
leaves a carry on the device (spec_programs ``_next_carry``: each row's next fed tokens, start and accepted
count); step N+1's rows read it (``token_src``), and their sampling steps move by the accepted count there. The
host reads N while N+1 runs, then dispatches N+1's commit and drafts with exact starts (``commit``): a request
that N finished is skipped, its extra verify work discarded as plain overlap discards a step's. Bounds stand in
for what the host does not know yet: ``draft_room`` and the pages count everything the step in flight fed as
accepted. Rows whose sampling follows their tokens (``can_carry``) and the steps after an extend or plain decode
step run synchronously.

Adaptive drafting (--speculative-draft-policy adaptive, the default; no peer has it): acceptance collapses at long
context, and then a verify step costs more than the tokens it adds. Each request keeps a moving average alpha of
its per-draft acceptance (every draft the target compared, in verify steps and, below, in plain steps); with d
drafts it expects 1 + alpha + ... + alpha^d tokens from a verify step. A decode step verifies when the batch's
mean expected tokens exceed rho = (verify step time) / (plain decode step time), both measured on this server at
that batch size (medians of the steps' recent wall times, engine/scheduler/step_costs.py; rho = 1 until both
are known; a plain step probes the decode time after PROBE_EVERY verify steps, and a verify step probes the
verify time after PROBE_EVERY plain steps when the expected tokens exceed 1; each wait doubles while the
estimates keep choosing the other kind, up to PROBE_MAX; so a stale estimate of either kind cannot fix the step
kind for good, and a clear winner pays few probes), else it runs as a plain decode step. After a plain step the MTP
layer still drafts (its KV stays current, and its first draft against the sampled token keeps alpha current), so
verification resumes when acceptance recovers. Tokens are the same either way; only the step kind changes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.runner.model_runner import SampleOutput, SamplingBatch, StepOutput
from sglang_tpu_qwen.engine.runner.spec_programs import split_accepted
from sglang_tpu_qwen.engine.scheduler.schedule_batch import (
    PickedBatch,
    RowInputs,
    ScheduleBatch,
    batch_rows,
    host_forward_batch,
    sampling_batch,
)
from sglang_tpu_qwen.engine.scheduler.step_costs import StepCosts
from sglang_tpu_qwen.grammar.bitmask import MaskRow, bitmask_width
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.scheduler.scheduler import Scheduler


# Adaptive drafting: the acceptance prior of a new request, the weight of one comparison in its moving average,
# the steps of one kind between probes of the other kind's step time, and the longest wait between verify probes
# (the wait doubles after each probe while the estimates keep choosing plain steps).
ALPHA_PRIOR = 0.7
ALPHA_WEIGHT = 0.2
PROBE_EVERY = 32
PROBE_MAX = 1024
NO_SNAPSHOTS = 2**30  # a row's snapshot position where no snapshot is taken (it never lags)


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a verify step yields for a request with per-draft acceptance ``alpha`` and ``drafts`` drafts:
    ``1 + alpha + ... + alpha^drafts`` (draft i is accepted only if the i - 1 before it were)."""
    return sum(alpha**i for i in range(drafts + 1))


@dataclasses.dataclass
class SpecStats:
    """Counters over the server's life: verify rows (one request in one verify step), tokens they produced
    (accepted drafts plus the target's own token) and draft tokens offered."""

    verify_steps: int = 0
    verify_rows: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    plain_steps: int = 0  # decode steps run without verification (adaptive drafting)
    undrafted_rows: int = 0  # verify rows that could have drafted but had no drafts (e.g. a PD hand-over without)

    @property
    def avg_accept_length(self) -> float:
        """SGLang's ``avg_spec_accept_length``: tokens per request per verify step (1.0 = no draft accepted)."""
        return self.accepted_tokens / self.verify_rows if self.verify_rows else 0.0


class SpecDecoder:
    """Builds verify steps, accepts their tokens, commits the GDN states and drafts (module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.steps = self.runner.spec_steps
        self.tokens = self.steps + 1
        self.page_size = scheduler.page_size
        self.stats = SpecStats()
        self.adaptive = scheduler.args.speculative_draft_policy == "adaptive"
        self.costs = StepCosts()
        self._verify_run = 0  # verify steps since the last plain one
        self._plain_run = 0  # plain decode steps since the last verify one
        self._verify_probe_every = PROBE_EVERY  # plain steps before a verify probe (doubles while probes lose)
        self._decode_probe_every = PROBE_EVERY  # verify steps before a plain probe (the same)

    # ---- adaptive drafting -------------------------------------------------------------------------
    def use_verify(self, reqs: list[Request]) -> bool:
        """Whether this decode step verifies drafts (module docstring); starts timing the step either way."""
        ctx = self.scheduler.policy.context_length
        counts = [self.draft_count(r, ctx) for r in reqs]
        rows_per_rank = max(sum(r.rank == k for r in reqs) for k in range(len(self.scheduler.ranks)))
        b = self.runner.buckets.decode_bucket(rows_per_rank).batch
        verify = any(counts)
        if verify and self.adaptive:
            cv, cd = self.costs.seconds("verify", b), self.costs.seconds("decode", b)
            gain = float(np.mean([expected_tokens(_alpha(r), n) for r, n in zip(reqs, counts, strict=True)]))
            # Each kind's time is probed now and then while the other kind runs: one sample taken at a bad
            # moment (after an idle gap, a prefill) must not decide the step kind for good.
            # A probe that keeps losing waits twice as long each time: on the v5e, plain probes every 32 verify
            # steps cost 4% of a batch-1 run whose verify steps won by 1.6x.
            if cv is not None and self._verify_run >= self._decode_probe_every:
                verify = False  # probe the plain step's time at this batch size
                self._decode_probe_every = min(2 * self._decode_probe_every, PROBE_MAX)
            elif gain > 1.0 and self._plain_run >= self._verify_probe_every:
                verify = True  # probe the verify step's time
                self._verify_probe_every = min(2 * self._verify_probe_every, PROBE_MAX)
            else:
                verify = gain > (cv / cd if cv and cd else 1.0)
                if verify:
                    self._verify_probe_every = PROBE_EVERY
                else:
                    self._decode_probe_every = PROBE_EVERY
        self._verify_run, self._plain_run = (self._verify_run + 1, 0) if verify else (0, self._plain_run + 1)
        self.costs.start("verify" if verify else "decode", b)
        return verify

    def step_dropped(self) -> None:
        """The decode step `use_verify` was asked about is not launched (its rows all finished meanwhile)."""
        self.costs.drop_last()

    def step_failed(self) -> None:
        """A step failed (StepFailures rewinds its requests): no timing or in-flight verify is left."""
        self.costs.clear()
        for r in self.scheduler.requests():
            r.verify_fed = 0

    # ---- verify step ---------------------------------------------------------------------------
    def draft_room(self, r: Request, context_length: int) -> int:
        """How many drafts r may feed in its next verify step: none past what r may still generate or hold,
        counting all the tokens its verify step in flight fed as accepted (the host does not know yet)."""
        ahead = r.verify_fed
        room = min(r.max_new_tokens - len(r.output_ids) - ahead - 1, context_length - len(r.fill_ids) - ahead,
                   len(r.pages) * self.page_size - len(r.fill_ids) - ahead)
        return max(0, min(self.steps, room))

    def draft_count(self, r: Request, context_length: int) -> int:
        """How many drafts r feeds in its next verify step: its MTP drafts within `draft_room` (a carried row's
        k drafts are on the device)."""
        room = self.draft_room(r, context_length)
        return room if r.verify_fed else len(r.draft_tokens[:room])

    def can_carry(self, r: Request) -> bool:
        """Whether r's next verify step may be built before its step in flight is read: its sampling settings
        must not follow the tokens that step yields (no grammar mask, no penalty counts, no min_new_tokens bans
        left: with ``ignore_eos`` and no stop_token_ids it bans nothing)."""
        sp = r.params
        return (r.grammar is None and not sp.has_penalty
                and (len(r.output_ids) >= sp.min_new_tokens or not sp.bans_stop_tokens))

    def _plain_greedy(self, r: Request) -> bool:
        """Whether r's verify positions sample as the greedy program does (`SamplingBatch.greedy_only` for its
        rows): greedy, no logprobs or logit bias, and what `can_carry` asks (no grammar, penalty or
        min_new_tokens bans)."""
        sp = r.params
        return sp.greedy and not r.return_logprob and not sp.logit_bias and self.can_carry(r)

    def build(self, picked: PickedBatch, eos_ids: Any, vocab_size: int, prev: ScheduleBatch | None) -> ScheduleBatch:
        """A DECODE pick laid out as a verify step: row b feeds [last token, drafts...] (T = k + 1), and its
        sampling batch has one row per position (b * T + t). A row whose verify step `prev` is in flight takes
        its fed tokens and start from the device (forward.token_src: its row in `prev`)."""
        buckets, ctx = self.runner.buckets, self.scheduler.policy.context_length
        rows, bucket = batch_rows(picked.reqs, picked.extend_lens, ForwardMode.DECODE, buckets)
        b, t = bucket.batch, self.tokens
        prev_rows = {} if prev is None else {id(r): i for r, i in zip(prev.reqs, prev.rows, strict=True)}
        # All rows plain greedy: the commit program samples, and the per-position sampling rows are not built.
        greedy = all(self._plain_greedy(r) for r in picked.reqs)
        fills: list[RowInputs] = []
        lens: list[int] = []
        s_reqs: list[Request] = []
        s_rows: list[int] = []
        offsets: list[int] = []
        ahead: list[list[int]] = []
        masks: list[MaskRow | None] = []
        for r, i in zip(picked.reqs, rows, strict=True):
            rows_mask, ids, src = None, None, -1
            if r.verify_fed:
                assert id(r) in prev_rows and self.can_carry(r), f"{r.rid}: carried but not in the step in flight"
                src = prev_rows[id(r)]
                drafts = [0] * self.draft_room(r, ctx)  # on the device
            else:
                drafts = self.drafts_for(r, ctx)
                if not r.draft_tokens and self.draft_room(r, ctx):
                    self.stats.undrafted_rows += 1
                if self._snapshot_lags(r):  # no token past the next page boundary, where the snapshot is due
                    drafts = drafts[: self.page_size - r.cached_len % self.page_size - 1]
                if r.grammar is not None:  # each position's mask follows the drafts before it
                    rows_mask = np.full((1 + len(drafts), bitmask_width(vocab_size)), -1, np.int32)
                    drafts = drafts[: r.grammar.fill_drafts(rows_mask, drafts)]
                ids = [r.fill_ids[r.cached_len], *drafts]
            n = 1 + len(drafts)
            fills.append(RowInputs(i, r.cached_len, n, r.slot, r.pages, ids, src))
            lens.append(n)
            for pos in range(0 if greedy else n):
                s_reqs.append(r)
                s_rows.append(i * t + pos)
                offsets.append(pos)
                ahead.append(drafts[:pos])
                masks.append(None if rows_mask is None else MaskRow(rows_mask[pos]))
        forward = host_forward_batch(ForwardMode.TARGET_VERIFY, (b, t, bucket.pages), fills)
        sampling = (SamplingBatch.greedy(b * t) if greedy else
                    sampling_batch(s_reqs, s_rows, b * t, eos_ids, vocab_size, offsets, ahead, masks))
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, list(picked.reqs), lens, rows, forward,
                             list(range(len(picked.reqs))), sampling)

    def drafts_for(self, r: Request, context_length: int) -> list[int]:
        """The drafts r feeds in its verify step (its MTP drafts, within `draft_room`)."""
        return r.draft_tokens[: self.draft_room(r, context_length)]

    def _snapshot_lags(self, r: Request) -> bool:
        """Whether r's decode snapshot lags the last page boundary it passed (its verify step then stops at the
        next one, so the snapshot catches up there); the device decides the same for a carried row
        (spec_programs: the commit's `behind`)."""
        cache = self.scheduler.ranks[r.rank].prefix_cache
        if cache is None or not cache.takes_snapshots:
            return False
        return r.cached_len // self.page_size * self.page_size > _snapshot_position(r)

    def commit(self, batch: ScheduleBatch, step: StepOutput, sampled: SampleOutput | None) -> jax.Array:
        """Launch the verify step's commit and drafts (StepExecutor.commit; `sampled` None: the commit samples
        the all-greedy step), once every step before it was read: each row's start is then exact, and a row
        finished or retracted meanwhile is skipped. A row whose fed tokens reach a page boundary gets its
        private decode snapshot slot (the prefix cache's), marked pending until the step is read; each
        committed row's `verify_fed` holds its fed tokens until then. Returns the device ``accepted`` array
        (spec_programs.split_accepted)."""
        forward = batch.forward
        fills: list[RowInputs] = []
        snaps = np.zeros((batch.batch_size, 2), np.int32)  # (slot, position of the snapshot so far)
        snaps[:, 1] = NO_SNAPSHOTS
        ps = self.page_size
        for r, n, row in zip(batch.reqs, batch.extend_lens, batch.rows, strict=True):
            if r.finished or r.slot is None:
                continue
            fills.append(RowInputs(row, r.cached_len, n, r.slot, forward.page_table[row]))
            r.verify_fed = n  # set only now: reading the step before cleared the previous value
            cache = self.scheduler.ranks[r.rank].prefix_cache
            if cache is None or not cache.takes_snapshots:
                continue
            snaps[row, 1] = _snapshot_position(r)
            if ps - r.cached_len % ps <= n:  # the run may end on a page boundary
                snaps[row, 0] = cache.verify_snapshot_slot(r)
                r.snapshot_pending = bool(snaps[row, 0])
        # The verify step's batch with exact starts (its input_ids and image inputs kept; no token_src).
        starts = host_forward_batch(forward.mode, (*forward.input_ids.shape, forward.page_table.shape[1]), fills,
                                    with_token_src=False)
        exact = dataclasses.replace(forward, prefix_lens=starts.prefix_lens, extend_lens=starts.extend_lens,
                                    slot_ids=starts.slot_ids, page_table=starts.page_table, token_src=None)
        return self.runner.commit(step, exact, sampled, snaps)

    def process_verify(self, batch: ScheduleBatch, accepted: np.ndarray,
                       sampled: tuple[np.ndarray, ...] | None) -> None:
        """Accept each request's tokens (the commit's `accepted` [B, 2 + k + T] read on the host: the device's
        accepted count of the tokens each row fed, its next drafts [k] and, for an all-greedy step, the sampled
        tokens; `sampled` the sampling program's output otherwise), stop checks token by token; move each
        start and decode snapshot with them and keep the next drafts."""
        out = self.scheduler.output
        got, fed_lens, drafts, greedy_toks = split_accepted(accepted, self.steps)
        if sampled is None:  # the commit sampled: greedy, no logprobs
            n = len(greedy_toks)
            sampled = (greedy_toks, np.zeros(n, np.float32), np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int32))
        toks, lps = sampled[0].tolist(), sampled[1].tolist()
        now = time.perf_counter()
        t, ps = self.tokens, self.page_size
        self.stats.verify_steps += 1
        for r, row in zip(batch.reqs, batch.rows, strict=True):
            r.verify_fed = 0
            if r.finished:  # aborted while the step ran
                continue
            g, n = int(got[row]), int(fed_lens[row])
            if r.snapshot_pending and not (g and (r.cached_len + g) % ps == 0):  # the commit wrote no snapshot
                r.snapshot_pending = False
            taken = 0
            for pos in range(g):
                k = row * t + pos
                top = (sampled[2][k], sampled[3][k]) if r.top_logprobs_num else (None, None)
                out.accept_token(r, toks[k], lps[k], *top, now)
                taken += 1
                if pos < n - 1:  # the target's token compared with draft pos: one acceptance observation
                    _observe(r, pos < g - 1)
                if r.finished:
                    break
            r.spec_verify_ct += 1
            r.spec_accepted += taken - 1
            self.stats.verify_rows += 1
            self.stats.accepted_tokens += taken
            self.stats.draft_tokens += n - 1
            r.draft_tokens = []
            if r.finished or r.slot is None:  # finished inside the run, or retracted while the step ran
                continue
            if r.snapshot_pending:  # the commit wrote the state at the boundary into the private snapshot
                cache = self.scheduler.ranks[r.rank].prefix_cache
                assert cache is not None
                cache.verify_snapshot_taken(r, r.cached_len + g)
            r.cached_len += g
            r.draft_tokens = drafts[row].tolist()
        self.costs.done()  # the decode step was read: its time

    def after_decode(self, batch: ScheduleBatch, step: StepOutput) -> None:
        """A plain decode step (adaptive drafting chose it): its sampled tokens already accepted, compare each
        request's first draft with its token (alpha), then draft from this step's positions."""
        rows = []
        self.stats.plain_steps += 1
        for r, row in zip(batch.reqs, batch.rows, strict=True):
            if r.finished or r.slot is None:
                continue
            start = int(batch.forward.prefix_lens[row])
            if r.draft_tokens and len(r.fill_ids) > start + 1:
                _observe(r, r.fill_ids[start + 1] == r.draft_tokens[0])
            r.draft_tokens = []
            rows.append((r, row, start, r.fill_ids[start + 1 : start + 2], True))
        if rows:
            self._draft(step, batch.forward, rows)
        self.costs.done()  # the decode step was read: its time

    # ---- drafts --------------------------------------------------------------------------------
    def after_extend(self, batch: ScheduleBatch, step: StepOutput, sampled: tuple[np.ndarray, ...] | None) -> None:
        """The MTP layer over an extend step's positions (its KV for the prompt), before the sampled tokens are
        accepted (a PD prefill server hands the request over on accepting its first token, KV and drafts
        included): a row that finished its prompt reads the token the step sampled as the one after its last
        position, and gets the drafts for its first verify step."""
        rows = []
        toks = None if sampled is None else sampled[0]
        finishing = set(batch.finishing)
        for i, (r, n, row) in enumerate(zip(batch.reqs, batch.extend_lens, batch.rows, strict=True)):
            if r.finished or r.slot is None:
                continue
            start = int(batch.forward.prefix_lens[row])
            tokens = r.fill_ids[start + 1 : start + 1 + n]
            first = i in finishing and r.max_new_tokens != 0 and toks is not None
            if first and len(tokens) < n:
                tokens = [*tokens, int(toks[row])]
            rows.append((r, row, start, tokens, first))
        if rows:
            self._draft(step, batch.forward, rows)

    def _draft(self, step: StepOutput, forward: ForwardBatch,
               rows: list[tuple[Request, int, int, list[int], bool]]) -> None:
        """Run the draft program over rows (request, row, first position, the tokens after each position, whether
        the request takes the drafts) of `step`."""
        b, t = forward.input_ids.shape
        fills = [RowInputs(row, start, len(tokens), r.slot, r.pages, tokens)
                 for r, row, start, tokens, _ in rows if tokens]
        draft = host_forward_batch(ForwardMode.EXTEND if t > 1 else ForwardMode.DECODE,
                                   (b, t, forward.page_table.shape[1]), fills, with_token_src=False,
                                   rope_deltas=forward.rope_deltas)
        drafts = np.asarray(self.runner.draft(step, draft))
        for r, row, _, tokens, takes in rows:
            if takes and tokens:
                r.draft_tokens = drafts[row].tolist()

    def info(self) -> dict[str, Any]:
        """/get_server_info's speculative fields (SGLang's avg_spec_accept_length, and the counters)."""
        s = self.stats
        return {"avg_spec_accept_length": s.avg_accept_length, "spec_verify_steps": s.verify_steps,
                "spec_verify_rows": s.verify_rows, "spec_accepted_tokens": s.accepted_tokens,
                "spec_draft_tokens": s.draft_tokens, "spec_plain_steps": s.plain_steps,
                "spec_undrafted_rows": s.undrafted_rows,
                "speculative_num_steps": self.steps,
                "speculative_draft_policy": "adaptive" if self.adaptive else "always",
                # Measured wall seconds per decode step by mode and batch size (adaptive drafting's rho).
                "spec_step_seconds": self.costs.as_dict()}


def _snapshot_position(r: Request) -> int:
    """Tokens r's private decode snapshot holds (0: none yet)."""
    return 0 if r.private_snapshot is None else r.private_snapshot[1]


def _alpha(r: Request) -> float:
    return ALPHA_PRIOR if r.spec_alpha is None else r.spec_alpha


def _observe(r: Request, accepted: bool) -> None:
    """One draft-vs-target comparison of r into its acceptance average."""
    r.spec_alpha = (1 - ALPHA_WEIGHT) * _alpha(r) + ALPHA_WEIGHT * float(accepted)
