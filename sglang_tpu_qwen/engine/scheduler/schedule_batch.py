"""PickedBatch and ScheduleBatch: one step's requests, then its model inputs (SGLang's schedule_batch.py).

The policy (schedule_policy.py) picks a `PickedBatch`: the step's mode, its requests and how many new tokens
each feeds. Failure handling (step_failures.py) and the serving role's hooks (scheduler_role.py) take that
object too. `ScheduleBatch.build` lays a pick out in batch rows and fills every host array of the step in one
place: the model inputs as one `ForwardBatch` (model/forward_batch.py, numpy leaves, filled by
`host_forward_batch`, which the speculative steps use too) and, when a row samples, the sampling batch. The
runner runs it and the output processor (output_processor.py) reads the results back by row.

Row layout with --dp-size N: rank r's rows are [r*B/N, (r+1)*B/N) of the B rows (B: the batch of the step's
compiled bucket, engine/runner/buckets.py), so each DP rank's shard of the batch holds only its own requests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.io.request_images import Encode
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, StepBucket
from sglang_tpu_qwen.engine.runner.model_runner import SamplingBatch
from sglang_tpu_qwen.engine.scheduler.image_step import add_image_inputs
from sglang_tpu_qwen.grammar.bitmask import RowFiller, allows_other_than, token_bitmask
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_qwen.utils.shapes import next_pow2


@dataclass(frozen=True)
class ImageInputs:
    """What a vision model's steps need to place images: the text hidden size and the encoder (None: none yet)."""

    hidden: int
    encode: Encode | None


@dataclass(frozen=True)
class PickedBatch:
    """The requests of one step before layout: reqs[i] feeds extend_lens[i] new tokens from its cached_len.

    mode is EXTEND (prompt chunks) or DECODE (extend_lens all 1); IDLE with no requests when nothing runs.
    The requests hold the pages for cached_len + extend_lens[i] tokens and a slot (the policy saw to both).
    """

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]

    def __post_init__(self) -> None:
        assert len(self.reqs) == len(self.extend_lens), "one extend length per request"

    @classmethod
    def idle(cls) -> PickedBatch:
        """The empty pick: nothing to run this step."""
        return cls(ForwardMode.IDLE, [], [])

    @property
    def is_extend(self) -> bool:
        return self.mode is ForwardMode.EXTEND

    @property
    def num_extend_tokens(self) -> int:
        """New tokens the step feeds, all requests together."""
        return sum(self.extend_lens)

    def __len__(self) -> int:
        return len(self.reqs)

    def only(self, i: int) -> PickedBatch:
        """The batch of reqs[i] alone, with its extend length."""
        return PickedBatch(self.mode, [self.reqs[i]], [self.extend_lens[i]])


@dataclass(frozen=True)
class ScheduleBatch(PickedBatch):
    """A pick laid out in batch rows with the host arrays of its step (B rows including padding rows).

    reqs[i] lives in batch row rows[i]. `forward` holds the model inputs (host numpy int32, B x T of the
    step's bucket, T = 1 in DECODE; its extend_lens are per row, 0 on padding rows, which are all-zero: page 0 /
    slot 0, the trash targets). `finishing` lists the indices i whose pending tokens are all fed by this
    step: those rows sample their next token (unless the request only scores its prompt).
    With one DP rank an extend step lays its finishing requests out first and its sampling batch holds only
    their rows (the smallest sampling batch size that does): mid-prompt rows sample nothing.
    Overlap scheduling: a decode row whose token is still on the device (r.tokens_in_flight, sampled by the
    step in flight, `prev`) reads it there: forward.token_src names its row in that step (-1: input_ids[b]).
    """

    rows: list[int]
    forward: ForwardBatch
    finishing: list[int]
    sampling: SamplingBatch | None  # None when no row samples (mid-prompt chunks or scoring only)

    @property
    def batch_size(self) -> int:
        """B: rows of the step's bucket, padding rows included."""
        return self.forward.batch_size

    @classmethod
    def build(cls, picked: PickedBatch, buckets: BucketSet, eos_ids: Collection[int], vocab_size: int,
              prev: ScheduleBatch | None = None, images: ImageInputs | None = None) -> ScheduleBatch:
        """Lay out `picked` (EXTEND or DECODE, at least one request) in the rows of the step's compiled bucket
        and fill the host arrays of the step.

        The chunks must fit a bucket (the policy capped them). `prev`: the step in flight (overlap), whose
        sampled ids feed this step's rows whose token is in flight. `images`: a vision model's (hidden size,
        encoder): the step gets its rope deltas, and M-RoPE positions and image embeddings when a chunk holds
        image tokens (image_step.py).
        """
        mode = picked.mode
        assert mode is not ForwardMode.IDLE and picked.reqs, "an idle pick has nothing to lay out"
        order = list(range(len(picked)))
        finishing_only = mode is ForwardMode.EXTEND and buckets.samples_finishing_rows_only
        if finishing_only:  # rows that finish their prompt first: the step samples rows [0, k) only
            order.sort(key=lambda j: picked.extend_lens[j] != picked.reqs[j].pending)
        reqs = [picked.reqs[j] for j in order]
        lens = [picked.extend_lens[j] for j in order]
        rows, bucket = batch_rows(reqs, lens, mode, buckets)
        b = bucket.batch
        prev_rows = {} if prev is None else {id(r): i for r, i in zip(prev.reqs, prev.rows, strict=True)}
        fills: list[RowInputs] = []
        for r, n, i in zip(reqs, lens, rows, strict=True):
            ids, src = None, -1
            if r.tokens_in_flight:  # a decode row fed by the step in flight: its token never left the device
                assert n == 1 and id(r) in prev_rows, f"{r.rid}: token in flight but not in the previous step"
                src = prev_rows[id(r)]
            else:
                ids = r.fill_ids[r.cached_len : r.cached_len + n]
            fills.append(RowInputs(i, r.cached_len, n, r.slot, r.pages, ids, src))
        forward = host_forward_batch(mode, (b, bucket.tokens, bucket.pages), fills)
        if images is not None:
            forward = add_image_inputs(forward, reqs, lens, rows, images.hidden, images.encode)
        finishing = [i for i, (r, n) in enumerate(zip(reqs, lens, strict=True)) if n == r.pending]
        samples = any(reqs[i].max_new_tokens != 0 for i in finishing)
        sampling = None
        if samples and finishing_only:
            k = len(finishing)
            assert finishing == list(range(k))
            sampling = sampling_batch(reqs[:k], rows[:k], buckets.decode_bucket(k).batch, eos_ids, vocab_size)
        elif samples:
            sampling = sampling_batch(reqs, rows, b, eos_ids, vocab_size)
        return cls(mode, reqs, lens, rows, forward, finishing, sampling)

    @property
    def sampling_reqs(self) -> list[Request]:
        """Requests that get a new token from this step (finishing rows that do not only score)."""
        if self.sampling is None:
            return []
        return [r for r in (self.reqs[i] for i in self.finishing) if r.max_new_tokens != 0]


class RowInputs(NamedTuple):
    """One row of a host ForwardBatch (`host_forward_batch`): what a request feeds in a step."""

    row: int  # batch row
    prefix_len: int  # tokens already in the cache
    extend_len: int  # tokens this step feeds
    slot: int  # GDN state slot
    pages: Sequence[int]  # KV pages from position 0 on (the start of the row's page table)
    input_ids: Sequence[int] | None = None  # the extend_len tokens fed; None: they stay 0 (on the device)
    token_src: int = -1  # row of the previous step's sampled ids that feeds this row (overlap); -1: input_ids


def host_forward_batch(mode: ForwardMode, shape: tuple[int, int, int], rows: Iterable[RowInputs], *,
                       with_token_src: bool = True, rope_deltas: Any = None) -> ForwardBatch:
    """The host ForwardBatch of one step: `rows` laid out in B rows of T token columns and P pages, every other
    row a padding row (all zero: page 0 / slot 0, the trash targets). shape is (B, T, P).

    Its arrays, numpy int32:
        input_ids    [B, T]  row.input_ids in columns [0, extend_len), 0 elsewhere (and where input_ids is None)
        prefix_lens  [B]     row.prefix_len
        extend_lens  [B]     row.extend_len (0 on padding rows)
        page_table   [B, P]  row.pages in columns [0, len(pages)), 0 elsewhere
        slot_ids     [B]     row.slot
        token_src    [B]     row.token_src, -1 on padding rows; None when not `with_token_src` (steps that no
                             token in flight feeds: the MTP draft and the verify commit)
    rope_deltas is passed through (None: text-only; a vision model's [B] int32).
    Used by ScheduleBatch.build and the speculative verify, commit and draft steps (speculative.py).
    """
    b, t, p = shape
    input_ids = np.zeros((b, t), np.int32)
    prefix_lens = np.zeros(b, np.int32)
    extend_lens = np.zeros(b, np.int32)
    slot_ids = np.zeros(b, np.int32)
    page_table = np.zeros((b, p), np.int32)
    token_src = np.full(b, -1, np.int32)
    for i, prefix_len, extend_len, slot, pages, ids, src in rows:
        if ids is not None:
            input_ids[i, :extend_len] = ids
        prefix_lens[i], extend_lens[i], slot_ids[i], token_src[i] = prefix_len, extend_len, slot, src
        page_table[i, : len(pages)] = pages
    return ForwardBatch(mode, input_ids, prefix_lens, extend_lens, page_table, slot_ids,
                        token_src if with_token_src else None, rope_deltas=rope_deltas)


def batch_rows(reqs: list[Request], lens: list[int], mode: ForwardMode,
               buckets: BucketSet) -> tuple[list[int], StepBucket]:
    """Batch row of each request and the step's bucket: rank r's rows are [r*B/dp, (r+1)*B/dp)."""
    dp = buckets.dp
    count = [0] * dp
    rows = []
    for r in reqs:
        count[r.rank] += 1
    if mode is ForwardMode.EXTEND:
        bucket, cap = buckets.extend_bucket(max(count), max(lens))
        assert cap == max(lens), "the policy caps chunks to the bucket"
    else:
        bucket = buckets.decode_bucket(max(count))
    per_rank = bucket.batch // dp
    count = [0] * dp
    for r in reqs:
        rows.append(r.rank * per_rank + count[r.rank])
        count[r.rank] += 1
    return rows, bucket


def sampling_batch(reqs: list[Request], rows: list[int], b: int, eos_ids: Collection[int],
                   vocab_size: int, offsets: list[int] | None = None, drafts: list[list[int]] | None = None,
                   masks: list[RowFiller | None] | None = None) -> SamplingBatch:
    """Per-row sampling settings of the step; padding rows are greedy with nothing banned.

    Speculative verify steps have one row per position of a request: row i samples the request's output token
    number num_output + offsets[i] (its random stream step and its min_new_tokens bans follow), after the
    request's tokens and `drafts[i]` (the drafts fed before that position: penalties count them), under
    `masks[i]`'s grammar mask where given (a mask filled ahead over the drafts; default the request's grammar).
    """
    offsets = offsets if offsets is not None else [0] * len(reqs)
    drafts = drafts if drafts is not None else [[] for _ in reqs]
    temperature = np.zeros(b, np.float32)
    top_p = np.ones(b, np.float32)
    top_k = np.zeros(b, np.int32)
    min_p = np.zeros(b, np.float32)
    seeds = np.zeros(b, np.uint32)
    steps = np.zeros(b, np.int32)
    rep = np.ones(b, np.float32)
    freq = np.zeros(b, np.float32)
    pres = np.zeros(b, np.float32)
    any_penalty = any(r.params.has_penalty for r in reqs)
    seen_ids = output_ids = None
    if any_penalty:
        ahead = max(len(d) for d in drafts)
        seen_ids = np.full((b, next_pow2(max(len(r.fill_ids) for r in reqs) + ahead, 16)), -1, np.int32)
        output_ids = np.full((b, next_pow2(max(len(r.output_ids) for r in reqs) + ahead, 16)), -1, np.int32)
    ban_lists: list[list[int]] = [[] for _ in range(b)]
    # Column by column (one numpy assignment per field, not per row): this runs on the scheduler thread
    # every step, beside the model on a CPU host.
    idx = np.asarray(rows, np.intp)
    sps = [r.params for r in reqs]
    temperature[idx] = [0.0 if sp.greedy else sp.temperature for sp in sps]
    top_p[idx] = [sp.top_p for sp in sps]
    top_k[idx] = [max(sp.top_k, 0) for sp in sps]
    min_p[idx] = [sp.min_p for sp in sps]
    seeds[idx] = [r.seed & 0xFFFFFFFF for r in reqs]
    # The token in flight counts: same stream with and without overlap (and with speculation: the offset).
    steps[idx] = [r.num_output + o for r, o in zip(reqs, offsets, strict=True)]
    rep[idx] = [sp.repetition_penalty for sp in sps]
    freq[idx] = [sp.frequency_penalty for sp in sps]
    pres[idx] = [sp.presence_penalty for sp in sps]
    for r, i, o, ahead in zip(reqs, rows, offsets, drafts, strict=True):
        sp = r.params
        if seen_ids is not None and output_ids is not None:
            # A token in flight is missing here; only rows without a penalty may have one (their counts
            # are not used), penalty rows run synchronously (Scheduler._can_overlap).
            assert not (r.tokens_in_flight and sp.has_penalty), f"{r.rid}: penalty row with a token in flight"
            n_seen, n_out = len(r.fill_ids), len(r.output_ids)
            seen_ids[i, :n_seen] = r.fill_ids
            output_ids[i, :n_out] = r.output_ids
            seen_ids[i, n_seen : n_seen + len(ahead)] = ahead
            output_ids[i, n_out : n_out + len(ahead)] = ahead
        if r.num_output + o < sp.min_new_tokens and sp.bans_stop_tokens:
            ban_lists[i] = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids)))
    bias_ids = bias_vals = None
    biases = [(i, r.params.logit_bias) for r, i in zip(reqs, rows, strict=True) if r.params.logit_bias]
    if biases:
        width = max(len(lb) for _, lb in biases)
        bias_ids = np.full((b, width), -1, np.int32)
        bias_vals = np.zeros((b, width), np.float32)
        for i, lb in biases:
            bias_ids[i, : len(lb)] = list(lb)
            bias_vals[i, : len(lb)] = list(lb.values())
    want_logprobs = any(r.return_logprob for r in reqs)
    num_top = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
    grammars: list[Any] = [None] * b
    for j, (r, i) in enumerate(zip(reqs, rows, strict=True)):
        assert r.grammar is None or not r.tokens_in_flight, "grammar rows run synchronously"
        grammars[i] = masks[j] if masks is not None and masks[j] is not None else r.grammar
    bitmask = token_bitmask(grammars, b, vocab_size)
    for i, g in enumerate(grammars):
        # The grammar wins: where it allows only banned ids (EOS before min_new_tokens), drop the bans.
        if g is not None and ban_lists[i] and bitmask is not None and not allows_other_than(bitmask, i, ban_lists[i]):
            ban_lists[i] = []
    banned = np.full((b, next_pow2(max(len(x) for x in ban_lists), 4)), -1, np.int32)
    for i, bans in enumerate(ban_lists):
        banned[i, : len(bans)] = bans
    return SamplingBatch(temperature, top_p, top_k, min_p, seeds, steps, rep, freq, pres, seen_ids,
                         output_ids, banned, want_logprobs, num_top, bitmask, bias_ids, bias_vals)
