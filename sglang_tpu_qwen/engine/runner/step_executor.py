"""The step executor: runs a prepared batch through the compiled programs (forward, sampling, penalties,
prompt logprobs) and returns device arrays without waiting for them.

The scheduler hands host (numpy) arrays already padded to a bucket (engine/runner/buckets.py); a shape outside
the compiled set raises instead of compiling. Benchmarks watch the steps through `StepObservers` (none is
attached while serving; bench/decode_timer.py, bench/device_idle.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

from sglang_tpu_qwen.engine.runner import sampler
from sglang_tpu_qwen.engine.runner.buckets import StepBucket
from sglang_tpu_qwen.engine.runner.device_state import DeviceState
from sglang_tpu_qwen.engine.runner.programs import PROMPT_LOGPROB_ROWS, ProgramTable, SampleKind, pack_step
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class SamplingBatch:
    """Host arrays of per-row sampling settings for one step; B rows (padding rows included).

    Widths marked "any" are padded by the runner to the fixed bounds of engine/runner/sampler.py (a wider one
    raises ValueError: validation keeps requests within them).
    """

    temperature: np.ndarray  # [B] float32
    top_p: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32, <= 0 off
    min_p: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] uint32
    steps: np.ndarray  # [B] int32
    repetition: np.ndarray  # [B] float32
    frequency: np.ndarray  # [B] float32
    presence: np.ndarray  # [B] float32
    seen_ids: np.ndarray | None  # [B, any] int32 prompt + output ids, -1 padded; None when no row has a penalty
    output_ids: np.ndarray | None  # [B, any] int32 output ids, -1 padded
    banned_ids: np.ndarray  # [B, <= BAN_WIDTH] int32, -1 padded: ids masked out (EOS before min_new_tokens)
    want_logprobs: bool  # any row returns logprobs
    num_top_logprobs: int  # top alternatives wanted by any row (<= TOP_LOGPROBS_MAX)
    token_bitmask: np.ndarray | None = None  # [B, ceil(V/32)] int32 grammar mask (grammar/bitmask.py); None: no grammar
    bias_ids: np.ndarray | None = None  # [B, <= LOGIT_BIAS_WIDTH] int32 logit_bias ids, -1 padded
    bias_vals: np.ndarray | None = None  # [B, same] float32 logit_bias values

    @classmethod
    def greedy(cls, b: int) -> SamplingBatch:
        """B greedy rows with nothing else set (no penalty, bias, ban, grammar or logprobs)."""
        zeros_f = np.zeros(b, np.float32)
        return cls(zeros_f, np.ones(b, np.float32), np.zeros(b, np.int32), zeros_f, np.zeros(b, np.uint32),
                   np.zeros(b, np.int32), np.ones(b, np.float32), zeros_f, zeros_f, None, None,
                   np.full((b, 4), -1, np.int32), False, 0)

    def greedy_only(self) -> bool:
        """Whether the greedy program samples this batch: no row samples (temperature > 0), wants logprobs, has
        a penalty, a grammar mask, a logit bias or banned ids (their [B, V] scatter made the greedy program
        relayout the logits twice on a TPU: the sample program takes them, at temperature 0 the same argmax)."""
        return not (self.want_logprobs or self.token_bitmask is not None or self.seen_ids is not None
                    or bool((self.temperature > 0.0).any()) or bool((self.banned_ids >= 0).any())
                    or (self.bias_ids is not None and bool((self.bias_ids >= 0).any())))


class StepObserver(Protocol):
    """Benchmark hooks, called on the scheduler thread (times: time.perf_counter() seconds)."""

    def forward_dispatched(self, decode: bool, start: float, end: float) -> None:
        """A forward step was dispatched: `start` before its inputs were packed, `end` once the call returned
        (the program is enqueued by then)."""

    def sample_dispatched(self, tokens: jax.Array) -> None:
        """A decode step's sampling program was dispatched; `tokens` [B] int32 is its output."""

    def tokens_read(self, wait_s: float) -> None:
        """The host spent `wait_s` seconds blocked reading a decode step's sampled ids (SampleOutput.get)."""


_O = TypeVar("_O", bound=StepObserver)


class StepObservers:
    """The observers attached to a runner; `attached` is empty while serving (the steps then pay nothing)."""

    def __init__(self) -> None:
        self.attached: tuple[StepObserver, ...] = ()

    @contextlib.contextmanager
    def attach(self, observer: _O) -> Iterator[_O]:
        """`observer` sees every step of the block; detached when the block ends, raising or not."""
        self.attached = (*self.attached, observer)
        try:
            yield observer
        finally:
            self.attached = tuple(o for o in self.attached if o is not observer)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No observer sees the steps of the block."""
        saved, self.attached = self.attached, ()
        try:
            yield
        finally:
            self.attached = saved


@dataclass
class StepOutput:
    """Device result of one forward step: hidden [B, T, H] (prompt logprobs) and last [B, H], each row's
    hidden state at its last new token (sampling); a verify step's last is [B * T, H], every position
    (row b's token t at b * T + t), gdn_inputs what its commit reads (model/forward.py GdnInputs), and fed /
    step_shift as StepExecutor.verify returns them."""

    hidden: jax.Array
    last: jax.Array
    decode: bool = False
    gdn_inputs: Any = None
    fed: jax.Array | None = None  # a verify step's fed tokens [B, T] (device: carried rows included)
    fed_lens: jax.Array | None = None  # and how many of them each row fed [B]
    step_shift: jax.Array | None = None  # a verify step's carried rows' accepted counts [B]


@dataclass
class SampleOutput:
    """Device arrays of one sampling step, returned without waiting for the device (overlap scheduling
    keeps `tokens` on the device as the next step's input); `get()` blocks and copies to the host.

    tokens [B] int32; logprob [B] float32; top_logprobs [B, TOP_LOGPROBS_MAX] float32; top_ids [B, same] int32
    (the logprob arrays are zeros / width 0 unless the batch wanted logprobs).
    """

    tokens: jax.Array
    logprob: jax.Array
    top_logprobs: jax.Array
    top_ids: jax.Array
    num_top: int
    readers: tuple[StepObserver, ...] = ()  # decode steps: told how long get() blocked
    has_logprobs: bool = True  # False: the logprob arrays are zeros (greedy program, or f.logprobs off)

    def get(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Host copies (tokens, logprob, top_logprobs [B, num_top], top_ids [B, num_top])."""
        start = time.perf_counter()
        if self.has_logprobs:
            toks, lp, top_lp, top_ids = jax.device_get((self.tokens, self.logprob, self.top_logprobs,
                                                        self.top_ids))
        else:  # one transfer instead of four (each costs host time on the scheduler thread)
            # np.asarray, not jax.device_get: the latter's copy_to_host_async costs ~0.15 ms more of scheduler
            # time per step on XLA:CPU (measured), and one array gains nothing from an async copy.
            toks = np.asarray(self.tokens)
            b = len(toks)
            lp, top_lp, top_ids = np.zeros(b, np.float32), np.zeros((b, 0), np.float32), np.zeros((b, 0), np.int32)
        if self.readers:
            wait = time.perf_counter() - start
            for observer in self.readers:
                observer.tokens_read(wait)
        return (np.asarray(toks), np.asarray(lp), np.asarray(top_lp)[:, : self.num_top],
                np.asarray(top_ids)[:, : self.num_top])


class StepExecutor:
    """forward / sample / keep_sampled / logprobs_at over a program table and a device state."""

    def __init__(self, programs: ProgramTable, state: DeviceState) -> None:
        self.programs, self.state = programs, state
        self.placement = state.placement
        self.vocab_size = programs.config.vocab_size
        self.observers = StepObservers()
        self._unused: dict[int, sampler.RowParams] = {}  # per B: device arrays of "feature unused" inputs
        self._flags: dict[tuple[bool, ...], jax.Array] = {}  # resident Features arrays
        self._zeros: dict[int, jax.Array] = {}  # resident placeholder tokens of the commit programs

    def forward(self, batch: ForwardBatch) -> StepOutput:
        """Run one step on host arrays padded to a bucket; returns device arrays (does not wait).

        batch: input_ids [B, T] int32; prefix_lens, extend_lens, slot_ids [B] int32; page_table [B, P] int32
        with (B, T, P) one of the compiled buckets (ValueError otherwise; T == 1 exactly for a DECODE step).
        Page and slot ids are global; with dp > 1 rows [r*B/dp, (r+1)*B/dp) must use rank r's ids only
        (AssertionError otherwise). token_src [B] int32 (overlap scheduling): where >= 0, row b's first token
        is row token_src[b] of the ids the last `keep_sampled` call kept on the device (input_ids[b, 0] is
        ignored); -1 or None: host tokens.
        """
        b, t = batch.input_ids.shape
        if batch.mode.is_decode != (t == 1):
            raise ValueError(f"a {batch.mode.name} step with {t} token columns (DECODE steps have exactly 1)")
        images = batch.mrope_positions is not None
        if images and (not self.programs.vision or t == 1 or batch.image_embeds is None):
            raise ValueError("a step with M-RoPE positions needs a vision model, an extend step and its images")
        if self.programs.vision and batch.rope_deltas is None:  # a text step of a vision model: no delta
            batch = dataclasses.replace(batch, rope_deltas=np.zeros(b, np.int32))
        elif not self.programs.vision and batch.rope_deltas is not None:
            raise ValueError("rope deltas for a model without vision")
        prog = self.programs.get(("forward_mm" if images else "forward",
                                  StepBucket("decode" if t == 1 else "extend", b, t, batch.page_table.shape[1])))
        observers = self.observers.attached
        start = time.perf_counter() if observers else 0.0
        sizing, state = self.state.sizing, self.state
        packed = pack_step(batch, state.to_rank_local(batch.page_table, sizing.num_pages),
                           state.to_rank_local(batch.slot_ids, sizing.num_slots))
        prev = state.kept_tokens(self.programs.prev_rows)
        host = [packed]
        if images:  # [B, T, H] in the compute dtype, split by rows like the packed step
            host.append(np.asarray(batch.image_embeds).astype(self.programs.dtype, copy=False))
        on_device = self.placement.put(host)
        hidden, last, state.cache = prog(self.programs.param_leaves, state.cache, on_device[0], prev, *on_device[1:])
        if observers:
            end = time.perf_counter()
            for observer in observers:
                observer.forward_dispatched(t == 1, start, end)
        return StepOutput(hidden, last, decode=t == 1)

    # ---- speculative decoding (engine/runner/spec_programs.py) -------------------------------------
    def verify(self, batch: ForwardBatch) -> StepOutput:
        """The target over each row's last token and drafts (input_ids [B, k + 1], B a decode bucket's batch);
        GDN slots untouched until `commit`. A row with token_src[b] >= 0 takes its fed tokens and prefix from
        the carry the last verify step left on the device (its row token_src[b] there; overlap scheduling).
        Returns device arrays (does not wait): last is [B * (k + 1), H]; `fed` the tokens fed [B, k + 1],
        `fed_lens` [B] how many (a carried row stops at its page boundary where the carry says so) and
        `step_shift` [B] the carried rows' accepted counts (their sampling steps move by as many)."""
        spec = self._spec()
        b, t = batch.input_ids.shape
        if t != spec.tokens:
            raise ValueError(f"a verify step has {spec.tokens} token columns, got {t}")
        prog = self.programs.get(("verify", b))
        hidden, last, self.state.cache, saved, fed, fed_lens, shift = prog(
            spec.target_leaves, self.state.cache, self._packed(batch), self.state.kept_carry(spec.carry_shape))
        return StepOutput(hidden, last, gdn_inputs=saved, fed=fed, fed_lens=fed_lens, step_shift=shift)

    def sample_verify(self, step: StepOutput, batch: SamplingBatch) -> SampleOutput | None:
        """Sampling of a verify step's positions: None when the greedy program would sample them
        (`SamplingBatch.greedy_only`: the commit program samples them then, one dispatch less), else
        :meth:`sample`."""
        return None if batch.greedy_only() else self.sample(step, batch)

    def commit(self, step: StepOutput, batch: ForwardBatch, sampled: SampleOutput | None,
               snapshots: np.ndarray) -> jax.Array:
        """After verify step `step` and its sampling `sampled` (None: greedy, sampled here), in one program
        (spec_programs ``commit``): accept on the device (spec_programs accepted_lengths), commit the GDN states
        over the accepted tokens (where the run ends on a page boundary the state also goes to slot
        snapshots[b, 0], a global id, 0: none; snapshots[b, 1] is the position of the row's decode snapshot so
        far), draft the next tokens with the MTP layer over the accepted positions and keep the carry for the
        next verify step. `batch`: the step's rows with their exact prefix (extend_lens 0 and slot 0 for a row
        to skip). Returns ``accepted`` [B, 2 + k + k + 1] int32 on the device without waiting (accepted counts,
        tokens fed, drafts, sampled tokens: spec_programs.split_accepted)."""
        spec = self._spec()
        b = batch.batch_size
        packed = self._packed(batch)
        snap = np.asarray(snapshots, np.int32).copy()
        snap[:, 0] = self.state.to_rank_local(snap[:, 0], self.state.sizing.num_slots)
        on_device = self.placement.put([packed, snap])
        tokens = self._zero_tokens(b * spec.tokens) if sampled is None else sampled.tokens
        self.state.cache, accepted, self.state.spec_carry = self.programs.get(("commit", b))(
            spec.commit_leaves, self.programs.head_leaves, self.state.cache, on_device[0], step.gdn_inputs,
            step.hidden, step.fed, step.fed_lens, on_device[1], tokens, self.features((sampled is None,)))
        return accepted

    def draft(self, step: StepOutput, batch: ForwardBatch) -> jax.Array:
        """Draft tokens [B, k] int32 (device) from the MTP layer over `batch`'s positions: input_ids[b, t] the
        token after position prefix_lens[b] + t, step.hidden[b, t] the target's hidden state there
        (spec_programs._draft_tokens); writes the MTP layer's KV. (After an extend or a plain decode step;
        a verify step drafts in `commit`.)"""
        spec = self._spec()
        b, t = batch.input_ids.shape
        prog = self.programs.get(("draft", b, t, batch.page_table.shape[1]))
        drafts, self.state.cache = prog(spec.draft_leaves, self.state.cache, self._packed(batch),
                                        step.hidden)
        return drafts

    def _spec(self) -> Any:
        if self.programs.spec is None:
            raise ValueError("speculative decoding is off (--speculative-algorithm)")
        return self.programs.spec

    def _packed(self, batch: ForwardBatch) -> np.ndarray:
        if self.programs.vision and batch.rope_deltas is None:
            batch = dataclasses.replace(batch, rope_deltas=np.zeros(batch.batch_size, np.int32))
        sizing, state = self.state.sizing, self.state
        return pack_step(batch, state.to_rank_local(batch.page_table, sizing.num_pages),
                         state.to_rank_local(batch.slot_ids, sizing.num_slots))

    def keep_sampled(self, out: SampleOutput) -> None:
        """Keep out.tokens [B] on the device as the ids the next forward's token_src rows read (overlap
        scheduling: no host round trip between a step's sampling and the next step's input)."""
        self.state.prev_tokens = self.programs.get(("keep_sampled", out.tokens.shape[0]))(out.tokens)

    def sample(self, step: StepOutput, batch: SamplingBatch) -> SampleOutput:
        """Sample one token per row of `batch` (B rows) from step.last; returns device arrays without waiting
        (`.get()` reads). B below the step's rows samples its first B rows (a `head_rows` program).

        Runs the greedy program when every row is greedy and none wants logprobs, a penalty, a grammar, a
        logit bias or banned ids, else the sample program (which computes logprobs when a row wants them).
        Raises ValueError when a width exceeds its bound (num_top_logprobs > TOP_LOGPROBS_MAX, more than
        BAN_WIDTH bans or LOGIT_BIAS_WIDTH bias entries).
        """
        b = batch.temperature.shape[0]
        last = step.last
        if last.shape[0] != b:  # an extend step's finishing rows, rows [0, b) (ScheduleBatch.build)
            last = self.programs.get(("head_rows", last.shape[0], b))(last)
        if batch.num_top_logprobs > sampler.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs_num {batch.num_top_logprobs} > {sampler.TOP_LOGPROBS_MAX}")
        sampling = batch.temperature > 0.0
        use_bias = batch.bias_ids is not None and bool((batch.bias_ids >= 0).any())
        use_bans = bool((batch.banned_ids >= 0).any())
        use_grammar = batch.token_bitmask is not None
        use_penalty = batch.seen_ids is not None
        any_sampling = bool(sampling.any())
        kind: SampleKind = "greedy" if batch.greedy_only() else "sample"
        filters = (False,) * 4 if not any_sampling else (  # the per-row filters apply to sampling rows only
            bool(np.any(sampling & (batch.top_k > 0))), bool(np.any(sampling & (batch.top_k > sampler.TOP_K_BOUND))),
            bool(np.any(sampling & (batch.top_p < 1.0))), bool(np.any(sampling & (batch.min_p > 0.0))))
        feats = self.features((use_grammar, use_penalty, use_bias, *filters, batch.want_logprobs))
        # Host-to-device copies cost scheduler-thread time every step: a greedy step sends only its bans/bias.
        rows = [] if kind == "greedy" else [
            batch.temperature.astype(np.float32), batch.top_p.astype(np.float32), batch.top_k.astype(np.int32),
            batch.min_p.astype(np.float32), batch.seeds.astype(np.uint32), batch.steps.astype(np.int32),
            batch.repetition.astype(np.float32), batch.frequency.astype(np.float32),
            batch.presence.astype(np.float32)]
        optional: dict[str, np.ndarray] = {}
        if use_bias:
            assert batch.bias_ids is not None and batch.bias_vals is not None
            optional["bias_ids"] = _pad_cols(batch.bias_ids, sampler.LOGIT_BIAS_WIDTH, -1, "logit_bias entries")
            optional["bias_vals"] = _pad_cols(batch.bias_vals, sampler.LOGIT_BIAS_WIDTH, 0.0, "logit_bias entries")
        if use_bans:
            optional["ban_ids"] = _pad_cols(batch.banned_ids, sampler.BAN_WIDTH, -1, "banned ids")
        if use_grammar:
            assert batch.token_bitmask is not None
            optional["bitmask"] = batch.token_bitmask.astype(np.int32)
        put = self.placement.put(rows + list(optional.values()))
        fields = dict(zip(sampler.RowParams._fields[: len(rows)], put[: len(rows)], strict=True))
        fields.update(zip(optional, put[len(rows):], strict=True))
        if use_penalty:
            fields["penalty_table"] = self._penalty_table(b, batch)
        if kind != "greedy" and step.step_shift is not None:  # carried verify rows: their steps move on the device
            fields["steps"] = self.programs.get(("spec_steps", step.step_shift.shape[0]))(fields["steps"],
                                                                                        step.step_shift)
        # The inputs this step does not set stay the resident "unused" arrays.
        row_params = self.unused_inputs(b)._replace(**fields)
        out = self.programs.get(("sample", kind, b))(self.programs.head_leaves, last, row_params, feats)
        readers = self.observers.attached if step.decode else ()
        for observer in readers:
            observer.sample_dispatched(out[0])
        return SampleOutput(*out, num_top=batch.num_top_logprobs if batch.want_logprobs else 0,
                            readers=readers, has_logprobs=batch.want_logprobs)

    def logprobs_at(
        self, step: StepOutput, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray, num_top: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Logprob of targets[i] predicted at step.hidden[rows[i], cols[i]] (prompt logprobs).

        rows, cols, targets: [N] int32; num_top <= TOP_LOGPROBS_MAX (ValueError otherwise). Returns (logprob
        [N], top_logprobs [N, num_top], top_ids [N, num_top]). The picked hidden rows go through the host
        (prompt logprobs only), then PROMPT_LOGPROB_ROWS at a time through one fixed program.
        """
        if num_top > sampler.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs_num {num_top} > {sampler.TOP_LOGPROBS_MAX}")
        picked = np.asarray(jax.device_get(step.hidden))[rows, cols]
        prog = self.programs.get(("prompt_logprobs",))
        n, m = len(rows), PROMPT_LOGPROB_ROWS
        lps, tops, ids = [], [], []
        head = self.programs.head_params
        for start in range(0, n, m):
            h = picked[start : start + m]
            tgt = targets[start : start + m].astype(np.int32)
            pad = m - len(h)
            h = np.pad(h, ((0, pad), (0, 0)))
            tgt = np.pad(tgt, (0, pad))
            lp, top_lp, top_ids = jax.device_get(prog(head, *self.placement.put([h, tgt], replicated=True)))
            lps.append(np.asarray(lp)[: m - pad])
            tops.append(np.asarray(top_lp)[: m - pad, :num_top])
            ids.append(np.asarray(top_ids)[: m - pad, :num_top])
        return np.concatenate(lps), np.concatenate(tops), np.concatenate(ids)

    def warm_up(self) -> None:
        """Execute each step and sampling program once on padding rows (trash page 0 and slot 0, nothing
        sampled for a request), unobserved: XLA:CPU initialises an executable on its first run (~30 ms
        measured per program), which would otherwise land on the first request of each shape."""
        buckets = self.programs.buckets
        outs: dict[int, StepOutput] = {}
        extend_outs: dict[int, StepOutput] = {}
        with self.observers.paused():
            for bucket in buckets.step_buckets():
                b, zeros = bucket.batch, np.zeros(bucket.batch, np.int32)
                out = self.forward(_padding_batch(bucket, zeros))
                (outs if bucket.mode == "decode" else extend_outs)[b] = out
                if self.programs.vision and bucket.mode == "extend":
                    h = self.programs.config.hidden_size
                    self.forward(dataclasses.replace(
                        _padding_batch(bucket, zeros), mrope_positions=np.zeros((b, bucket.tokens, 3), np.int32),
                        image_embeds=np.zeros((b, bucket.tokens, h), self.programs.dtype)))
            for big, b in buckets.head_rows_pairs():
                self.programs.get(("head_rows", big, b))(extend_outs[big].last)
            for b in buckets.sample_batches():
                none = np.full((b, 1), -1, np.int32)
                base = dataclasses.replace(SamplingBatch.greedy(b), banned_ids=none)
                for batch in (base, dataclasses.replace(base, temperature=np.ones(b, np.float32), seen_ids=none,
                                                        output_ids=none),
                              dataclasses.replace(base, want_logprobs=True)):
                    self.keep_sampled(self.sample(outs[b], batch))
            first = next(iter(outs.values()))
            one = np.zeros(1, np.int32)
            self.logprobs_at(first, one, one, one, 0)
            if self.programs.spec is not None:
                self._warm_up_spec(outs, extend_outs)
            jax.block_until_ready(self.state.cache)

    def _warm_up_spec(self, outs: dict[int, StepOutput], extend_outs: dict[int, StepOutput]) -> None:
        """Run every verify, commit, draft and verify-sampling program once on padding rows (the commit both
        after a sampling program and sampling an all-greedy step itself)."""
        spec = self._spec()
        for bucket in self.programs.buckets.step_buckets():
            b, zeros = bucket.batch, np.zeros(bucket.batch, np.int32)
            if bucket.mode == "decode":
                vb = dataclasses.replace(_padding_batch(dataclasses.replace(bucket, tokens=spec.tokens), zeros),
                                         mode=ForwardMode.TARGET_VERIFY)
                n = b * spec.tokens
                sampling = dataclasses.replace(SamplingBatch.greedy(n), temperature=np.ones(n, np.float32),
                                               banned_ids=np.full((n, 1), -1, np.int32))
                for sampled in (True, False):
                    step = self.verify(vb)
                    self.commit(step, vb, self.sample(step, sampling) if sampled else None,
                                np.zeros((b, 2), np.int32))
                self.draft(outs[b], _padding_batch(bucket, zeros))  # after a plain decode step
            else:
                self.draft(extend_outs[b] if extend_outs[b].hidden.shape[1] == bucket.tokens else
                           self.forward(_padding_batch(bucket, zeros)), _padding_batch(bucket, zeros))
        self.state.spec_carry = None  # the padding steps' carry is nobody's

    # ---- resident inputs -----------------------------------------------------------------------
    def unused_inputs(self, b: int) -> sampler.RowParams:
        """Device arrays meaning "unused" for the optional inputs of a B-row sampling program, kept resident
        so a step that uses no penalty / bias / grammar copies nothing for them."""
        cached = self._unused.get(b)
        if cached is None:
            v = self.vocab_size
            host = dict(penalty_table=np.zeros((b, v), np.int32),
                        bias_ids=np.full((b, sampler.LOGIT_BIAS_WIDTH), -1, np.int32),
                        bias_vals=np.zeros((b, sampler.LOGIT_BIAS_WIDTH), np.float32),
                        ban_ids=np.full((b, sampler.BAN_WIDTH), -1, np.int32),
                        bitmask=np.full((b, -(-v // 32)), -1, np.int32))
            # The per-row values of an all-greedy batch (the greedy program reads none of them).
            host.update(temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32),
                        top_k=np.zeros(b, np.int32), min_p=np.zeros(b, np.float32), seeds=np.zeros(b, np.uint32),
                        steps=np.zeros(b, np.int32), repetition=np.ones(b, np.float32),
                        frequency=np.zeros(b, np.float32), presence=np.zeros(b, np.float32))
            arrays = {k: jax.device_put(a, self.placement.rows(a.ndim)) for k, a in host.items()}
            cached = self._unused[b] = sampler.RowParams(**arrays)
        return cached

    def resident_arrays(self) -> list[Any]:
        """The device arrays this executor keeps between steps (the "unused" sampling inputs, the Features
        flags, the commit's placeholder tokens): what ModelRunner.close frees with the pools."""
        return [*self._unused.values(), *self._flags.values(), *self._zeros.values()]

    def _zero_tokens(self, n: int) -> jax.Array:
        """[n] int32 zeros, resident: the sampled tokens a commit program that samples itself does not read."""
        arr = self._zeros.get(n)
        if arr is None:
            arr = self._zeros[n] = jax.device_put(np.zeros(n, np.int32), self.placement.rows(1))
        return arr

    def features(self, flags: tuple[bool, ...]) -> jax.Array:
        """sampler.Features (or another tuple of flags) as a resident replicated bool array, one per combination
        seen: no host-to-device copy per step."""
        arr = self._flags.get(flags)
        if arr is None:
            arr = self._flags[flags] = jax.device_put(np.asarray(flags, np.bool_), self.placement.replicated())
        return arr

    def _penalty_table(self, b: int, batch: SamplingBatch) -> jax.Array:
        """[B, V] int32 penalty table from the host's id lists, PENALTY_CHUNK ids per program call."""
        assert batch.seen_ids is not None and batch.output_ids is not None
        table = self.unused_inputs(b).penalty_table
        prog = self.programs.get(("penalty", b))
        c = sampler.PENALTY_CHUNK
        none = np.full((b, c), -1, np.int32)
        for phase, ids in enumerate((batch.seen_ids, batch.output_ids)):  # every seen chunk first
            for start in range(0, max(ids.shape[1], 1), c):
                chunk = _pad_cols(ids[:, start : start + c], c, -1, "ids")
                if start and not np.any(chunk >= 0):
                    break
                table = prog(table, *self.placement.put([none, chunk] if phase else [chunk, none]))
        return table


def _padding_batch(bucket: StepBucket, zeros: np.ndarray) -> ForwardBatch:
    """A batch of `bucket`'s shape whose every row is padding (trash page 0, slot 0, nothing fed)."""
    b = bucket.batch
    return ForwardBatch.of(np.zeros((b, bucket.tokens), np.int32), zeros, zeros, np.zeros((b, bucket.pages), np.int32),
                           zeros)


def _pad_cols(a: np.ndarray, width: int, fill: Any, what: str) -> np.ndarray:
    """[B, w] -> [B, width] padded with `fill`; ValueError when w > width."""
    if a.shape[1] > width:
        raise ValueError(f"{a.shape[1]} {what} in one row; at most {width}")
    out = np.full((a.shape[0], width), fill, a.dtype)  # not np.pad: ~20 us of Python per call, every step
    out[:, : a.shape[1]] = a
    return out
