"""The program table: every compiled program a runner runs, built once, lowered from abstract arguments.

The set is fixed (issue 12) and named by `keys()`: a forward per `StepBucket` (engine/runner/buckets.py), two
sampling programs per batch size (greedy, sample; engine/runner/sampler.py), one penalty-table and one
keep-sampled program per batch size, the `head_rows` programs that take an extend step's finishing rows, and
one prompt-logprob program. `ProgramTable.lower(key)` gives the `jax.stages.Lowered` of each from abstract
arguments with their shardings (precompile, and the deviceless planner); `get(key)` the compiled program,
refusing a key outside the set. The model is called in one place, the forward program's body.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.engine.runner import greedy_screen, sampler
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, StepBucket
from sglang_tpu_qwen.engine.runner.device_state import DeviceState, abstract
from sglang_tpu_qwen.engine.runner.spec_programs import SPEC_KINDS, SpecPrograms
from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.kernels.sampling_backend import SamplingBackend
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import compute_logits, forward_step, lm_head_weight
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward
from sglang_tpu_qwen.parallel.sharding import batch_pspec, param_pspecs

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 64  # positions per call of the prompt-logprob program
SampleKind = Literal["greedy", "sample"]
# Rows per pass of a "sample" program. Its temporaries are a few [rows, V] float32 arrays (the logits, their
# processed copy, the logprobs' second product): 3.79 GiB at 1,024 rows of Qwen3.5's 248,320-token vocabulary,
# the verify steps' sampling of a 256-running engine with MTP, which shrank its pools to 3.8 GiB on the v5e. A
# larger batch loops over blocks of this many rows (rows are independent: per-row seeds and steps), paying one
# more lm_head read per block.
SAMPLE_BLOCK_ROWS = 256
SAMPLE_KINDS: tuple[SampleKind, ...] = ("greedy", "sample")
STEP_COLUMNS = 4  # the [B] columns of a packed step between tokens and page_table


def head_params(params: dict[str, Any], config: Qwen35MoeConfig) -> dict[str, Any]:
    """The parameters the sampling and prompt-logprob programs read: the output projection (`lm_head`, or
    `embed` when tied) and its bfloat16 screen. Not the whole tree: a compiled call costs dispatch time
    per argument leaf on the scheduler thread (~0.5 ms per step for ~120 leaves on the 2-core CPU)."""
    keys = ["embed" if config.tie_word_embeddings else "lm_head", "lm_head_screen"]
    return {k: params[k] for k in keys if k in params}


class ProgramTable:
    """The jitted functions behind every program of the fixed set, and the compiled ones (nothing is compiled
    at construction)."""

    def __init__(self, config: Qwen35MoeConfig, params: dict[str, Any], state: DeviceState, buckets: BucketSet,
                 backends: KernelBackends, moe_combine: str, dtype: Any, spec_steps: int = 0,
                 draft_vocab: np.ndarray | None = None) -> None:
        """params: the weights (arrays or ShapeDtypeStructs) the programs take, as their flat list of leaves;
        state: the device state whose cache (and its shardings) the forward programs take; spec_steps: draft
        tokens per row with speculative decoding (engine/runner/spec_programs.py; 0: off; one device only);
        draft_vocab: the token ids the drafts choose among (--speculative-token-map; None: all)."""
        self.config, self.buckets, self.dtype = config, buckets, dtype
        self.state, self.placement = state, state.placement
        layout = self.placement.layout
        step = partial(forward_step, backends=backends)
        if layout is None:
            model: Callable[..., Any] = partial(step, config=config)
            last = _last_rows
        else:
            model = make_sharded_forward(layout, config, params, combine=moe_combine, forward=step)
            rows = batch_pspec(layout)
            last = jax.shard_map(_last_rows, mesh=layout.mesh, in_specs=(rows, rows), out_specs=rows,
                                 check_vma=False)

        # A compiled call costs scheduler-thread time per argument leaf (flattening, signature and layout
        # checks, one host-to-device copy per host array): the programs take the parameters as their flat
        # list of leaves (flattened once here, not a nested dict every step) and a step's host arrays as one.
        self.param_leaves, param_def = jax.tree.flatten(params)
        pages = buckets.pages
        # A vision-language checkpoint's steps carry a rope-delta column (M-RoPE text after an image, decode),
        # and its extend buckets have a second program with explicit 3-D positions and image embeddings.
        self.vision = vision = config.has_vision

        def forward_program(param_leaves, cache, packed, prev_tokens, image_embeds=None):
            # overlap: last step's ids stay on the device
            batch = unpack_step(packed, pages, prev_tokens, vision=vision, images=image_embeds)
            hidden, cache = model(jax.tree.unflatten(param_def, param_leaves), cache, batch)
            return hidden, last(hidden, jnp.maximum(batch.extend_lens - 1, 0)), cache

        self._forward_jit = jax.jit(forward_program, donate_argnums=(1,))
        # Same for sampling: the head parameters as their leaves, the Features flags as one bool array.
        self.head_params = head_params(params, config)
        self.head_leaves, head_def = jax.tree.flatten(self.head_params)
        per_rank = self._per_rank

        def sample_program(head_leaves, last, rp, flags, *, kind):
            run = per_rank(partial(_sample_program, config=config, kind=kind, sampling=backends.sampling))
            return run(jax.tree.unflatten(head_def, head_leaves), last, rp, sampler.Features(*flags))

        self._sample_jits = {kind: jax.jit(partial(sample_program, kind=kind)) for kind in SAMPLE_KINDS}

        def greedy_tokens(head_leaves, last):  # the greedy program's tokens, inside another program
            run = per_rank(partial(_greedy_tokens, config=config, sampling=backends.sampling), with_row_params=False)
            return run(jax.tree.unflatten(head_def, head_leaves), last)

        # Not donated: the first call reads the resident zero table of the "unused" inputs.
        self._penalty_jit = jax.jit(sampler.penalty_update,
                                    out_shardings=None if layout is None else self.placement.rows(2))
        self._prompt_lp_jit = jax.jit(partial(_prompt_logprobs, config=config))
        # Overlap scheduling: the sampled ids of a step, padded to prev_rows, feed the next step's forward.
        self.prev_rows = max(buckets.sample_batches())
        self._keep_sampled_jit = jax.jit(partial(_pad_rows, rows=self.prev_rows),
                                         out_shardings=self.placement.replicated())
        self._head_rows_jit = jax.jit(_head_rows, static_argnames="rows")
        self.spec: SpecPrograms | None = None
        if spec_steps:
            no_kept = jnp.zeros(1, jnp.int32)
            self.spec = SpecPrograms(
                config, self.param_leaves, param_def, state, buckets, backends, dtype, spec_steps,
                columns=lambda t, p: step_columns(t, p, vision, False),
                unpack=lambda packed, p: unpack_step(packed, p, no_kept, vision=vision), prev_rows=self.prev_rows,
                head_leaves=self.head_leaves, greedy=greedy_tokens, moe_combine=moe_combine, draft_vocab=draft_vocab)
        self._compiled: dict[tuple, Any] = {}
        self._key_set = set(self.keys())
        self.ready = False  # set once precompiled: a compilation after it is logged as an error

    # ---- the fixed set -------------------------------------------------------------------------
    def keys(self) -> list[tuple]:
        """Every program of the fixed set, as the keys `get` and `lower` take."""
        keys: list[tuple] = [("forward", bk) for bk in self.buckets.step_buckets()]
        if self.vision:  # steps whose chunk holds image tokens
            keys += [("forward_mm", bk) for bk in self.buckets.step_buckets() if bk.mode == "extend"]
        for b in self.buckets.sample_batches():
            keys += [("sample", kind, b) for kind in SAMPLE_KINDS]
            keys.append(("penalty", b))
            keys.append(("keep_sampled", b))
        keys += [("head_rows", big, b) for big, b in self.buckets.head_rows_pairs()]
        keys.append(("prompt_logprobs",))
        if self.spec is not None:  # verify steps sample every position of every row
            for b in self.spec.sample_batches():
                if b not in self.buckets.sample_batches():  # an all-greedy verify step samples in its commit
                    keys += [("sample", "sample", b), ("penalty", b)]
            keys += self.spec.keys()
        return keys

    def sample_batches(self) -> list[int]:
        """Every sampling batch size of the set (decode steps, and verify steps' positions)."""
        extra = self.spec.sample_batches() if self.spec is not None else []
        return sorted(set(self.buckets.sample_batches()) | set(extra))

    def lower_forward(self, bucket: StepBucket) -> jax.stages.Lowered:
        """The forward program of `bucket` lowered from abstract arguments (the parameter leaves, cache and
        the step's packed host array with their shardings): input packed [B, T + 4 + P] int32 (`pack_step`:
        tokens [B, T], prefix_lens, extend_lens, slot_ids, token_src [B], page_table [B, P]) and the kept
        sampled ids [prev_rows]; outputs (hidden [B, T, H], last [B, H], cache)."""
        return self._lower_forward(bucket, images=False)

    def _lower_forward(self, bucket: StepBucket, images: bool) -> jax.stages.Lowered:
        """A forward program lowered; `images` (vision models, extend buckets): the `forward_mm` program, whose
        packed step has 3 * T more columns (the [B, T, 3] positions) and which takes the image embeddings
        [B, T, H] in the compute dtype."""
        b, t, p = bucket.batch, bucket.tokens, bucket.pages
        spec = self.placement.spec
        cols = step_columns(t, p, self.vision, images)
        extra = (spec((b, t, self.config.hidden_size), self.dtype),) if images else ()
        return self._forward_jit.lower(abstract(self.param_leaves), abstract(self.state.cache),
                                       spec((b, cols), jnp.int32),
                                       spec((self.prev_rows,), jnp.int32, replicated=True), *extra)

    def lower_sample(self, kind: SampleKind, batch: int) -> jax.stages.Lowered:
        """Sampling program `kind` for B = `batch` rows: (leaves of head_params, last [B, H], RowParams,
        Features as one replicated bool array [len(Features._fields)]) -> (tokens [B], logprob [B],
        top_logprobs [B, K], top_ids [B, K]); K = TOP_LOGPROBS_MAX for "sample", 0 for "greedy"."""
        spec = self.placement.spec
        return self._sample_jits[kind].lower(
            abstract(self.head_leaves), spec((batch, self.config.hidden_size), self.dtype),
            self._row_param_specs(batch), spec((len(sampler.Features._fields),), jnp.bool_, replicated=True))

    def lower(self, key: tuple) -> jax.stages.Lowered:
        """The program `key` (one of `keys()`) lowered from abstract arguments; KeyError for another key."""
        spec, i32 = self.placement.spec, jnp.int32
        if key[0] == "forward":
            return self.lower_forward(key[1])
        if key[0] == "forward_mm":
            return self._lower_forward(key[1], images=True)
        if key[0] == "sample":
            return self.lower_sample(key[1], key[2])
        if key[0] == "penalty":
            chunk = spec((key[1], sampler.PENALTY_CHUNK), i32)
            return self._penalty_jit.lower(spec((key[1], self.config.vocab_size), i32), chunk, chunk)
        if key[0] == "prompt_logprobs":
            n, h = PROMPT_LOGPROB_ROWS, self.config.hidden_size
            return self._prompt_lp_jit.lower(abstract(self.head_params), spec((n, h), self.dtype, replicated=True),
                                             spec((n,), i32, replicated=True))
        if key[0] == "keep_sampled":
            return self._keep_sampled_jit.lower(spec((key[1],), i32))
        if key[0] == "head_rows":
            return self._head_rows_jit.lower(spec((key[1], self.config.hidden_size), self.dtype), rows=key[2])
        if key[0] in SPEC_KINDS and self.spec is not None:
            return self.spec.lower(key)
        raise KeyError(key)

    def get(self, key: tuple) -> Any:
        """The compiled program `key` (compiled now when precompile was skipped or did not cover it).

        Raises ValueError for a key outside the fixed set (a step shape no bucket holds)."""
        prog = self._compiled.get(key)
        if prog is None:
            if key not in self._key_set:
                raise ValueError(f"program {key} is outside the compiled set (engine/runner/buckets.py)")
            if self.ready:
                logger.error("compiling %s after the server was ready", key)
            else:
                logger.info("compiling %s (deferred: --disable-precompile)", key)
            prog = self._compiled[key] = self.lower(key).compile()
        return prog

    def compiled_items(self) -> list[tuple[tuple, Any]]:
        """(key, compiled program) of every program compiled so far (program_memory.measure reads them)."""
        return list(self._compiled.items())

    def compile_missing(self, progress: bool = True) -> int:
        """Compile (or load from the persistent cache) every program of the set not compiled yet; returns how
        many. Lowers on this thread (tracing holds the GIL), compiles on every core (XLA releases it); shows a
        tqdm bar when `progress`."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        keys = [k for k in self.keys() if k not in self._compiled]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool, \
                tqdm(total=len(keys), desc="precompile", unit="program", disable=not progress) as bar:
            futures = {pool.submit(self.lower(key).compile): key for key in keys}
            for fut in as_completed(futures):
                self._compiled[futures[fut]] = fut.result()
                bar.update(1)
        return len(keys)

    # ---- helpers -------------------------------------------------------------------------------
    def _row_param_specs(self, b: int) -> sampler.RowParams:
        v = self.config.vocab_size
        f32, i32 = jnp.float32, jnp.int32
        s = self.placement.spec
        return sampler.RowParams(
            temperature=s((b,), f32), top_p=s((b,), f32), top_k=s((b,), i32), min_p=s((b,), f32),
            seeds=s((b,), jnp.uint32), steps=s((b,), i32), repetition=s((b,), f32), frequency=s((b,), f32),
            presence=s((b,), f32), penalty_table=s((b, v), i32), bias_ids=s((b, sampler.LOGIT_BIAS_WIDTH), i32),
            bias_vals=s((b, sampler.LOGIT_BIAS_WIDTH), f32), ban_ids=s((b, sampler.BAN_WIDTH), i32),
            bitmask=s((b, -(-v // 32)), i32))

    def _per_rank(self, fn: Callable[..., Any], with_row_params: bool = True) -> Callable[..., Any]:
        """`fn(params, last, row_params, features)` (`with_row_params` False: `fn(params, last)`) run by each DP
        rank on its own rows.

        Without a mesh, fn itself. With one, a `shard_map` over the batch axes: rows are independent
        (per-row seeds), so each device samples the rows it computed and no data crosses devices (a
        global-batch jit would let XLA insert collectives for nothing). Features are replicated scalars.
        """
        layout = self.placement.layout
        if layout is None:
            return fn
        pspecs = param_pspecs(self.head_params, layout)
        rows = batch_pspec(layout)
        if not with_row_params:
            return jax.shard_map(fn, mesh=layout.mesh, in_specs=(pspecs, rows), out_specs=rows, check_vma=False)

        def run(params: Any, last: jax.Array, rp: sampler.RowParams, feats: sampler.Features) -> Any:
            rp_specs = sampler.RowParams(*([rows] * len(sampler.RowParams._fields)))
            f_specs = sampler.Features(*([P()] * len(sampler.Features._fields)))
            return jax.shard_map(fn, mesh=layout.mesh, in_specs=(pspecs, rows, rp_specs, f_specs),
                                 out_specs=rows, check_vma=False)(params, last, rp, feats)

        return run


# ---- program bodies ----------------------------------------------------------------------------
def step_columns(tokens: int, pages: int, vision: bool, images: bool) -> int:
    """Columns of a packed step (`pack_step`): T + 4 + P, plus 1 (rope delta) on a vision-language model, plus
    3 * T (the M-RoPE positions) in a step with image tokens."""
    return tokens + STEP_COLUMNS + pages + (1 if vision else 0) + (3 * tokens if images else 0)


def pack_step(batch: ForwardBatch, page_table: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
    """A step's host arrays as one [B, T + 4 + P] int32 array: columns input_ids [T], prefix_lens, extend_lens,
    slot_ids, token_src (-1 where None), page_table [P]; then rope_deltas [1] when the batch has them (vision
    models) and mrope_positions [3T] ([B, T, 3] row-major) when it has those. One host-to-device copy instead
    of six. `page_table` / `slot_ids`: the batch's, already rank-local."""
    b, t = batch.input_ids.shape
    vision, images = batch.rope_deltas is not None, batch.mrope_positions is not None
    packed = np.empty((b, step_columns(t, page_table.shape[1], vision, images)), np.int32)
    packed[:, :t] = batch.input_ids
    packed[:, t] = batch.prefix_lens
    packed[:, t + 1] = batch.extend_lens
    packed[:, t + 2] = slot_ids
    packed[:, t + 3] = -1 if batch.token_src is None else batch.token_src
    end = t + STEP_COLUMNS + page_table.shape[1]
    packed[:, t + STEP_COLUMNS:end] = page_table
    if vision:
        packed[:, end] = batch.rope_deltas
    if images:
        packed[:, end + 1:] = np.asarray(batch.mrope_positions).reshape(b, 3 * t)
    return packed


def unpack_step(packed: jax.Array, pages: int, prev_tokens: jax.Array, *, vision: bool = False,
                images: jax.Array | None = None) -> ForwardBatch:
    """Inverse of `pack_step` inside a program (P = `pages`), with token_src resolved: where token_src[b] >= 0,
    row b's first token is prev_tokens[token_src[b]] (prev_tokens [R] int32). T == 1 is a DECODE step.
    `vision`: the rope-delta column is there; `images` ([B, T, H], a `forward_mm` program): so are the
    positions, and the batch carries both."""
    width = packed.shape[1] - STEP_COLUMNS - pages - (1 if vision else 0)  # T, or 4T with the positions
    t = width // 4 if images is not None else width
    col = partial(jax.lax.index_in_dim, packed, axis=1, keepdims=False)
    tokens, src = packed[:, :t], col(t + 3)
    first = jnp.where(src >= 0, prev_tokens[jnp.clip(src, 0, prev_tokens.shape[0] - 1)], tokens[:, 0])
    end = t + STEP_COLUMNS + pages
    batch = ForwardBatch.of(tokens.at[:, 0].set(first), col(t), col(t + 1), packed[:, t + STEP_COLUMNS:end],
                            col(t + 2))
    if not vision:
        return batch
    mrope = None if images is None else packed[:, end + 1:].reshape(packed.shape[0], t, 3)
    return dataclasses.replace(batch, rope_deltas=col(end), mrope_positions=mrope, image_embeds=images)


def _last_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden [B, T, H], index [B] -> [B, H]: each row's hidden state at its last new token."""
    return hidden[jnp.arange(hidden.shape[0]), index]


def _head_rows(last: jax.Array, *, rows: int) -> jax.Array:
    """last [B, H] -> its first `rows` rows [rows, H]."""
    return last[:rows]


def _pad_rows(tokens: jax.Array, *, rows: int) -> jax.Array:
    """tokens [B] int32 -> [rows] (zeros after B)."""
    return jnp.zeros(rows, jnp.int32).at[: tokens.shape[0]].set(tokens.astype(jnp.int32))


def _sample_program(params, last, rp, f, *, config, kind, sampling: SamplingBackend):
    """One sampling program (params: head_params()): logits of `last` [B, H] -> (tokens [B]
    int32, logprob [B], top_logprobs [B, K], top_ids [B, K]). "greedy" takes the argmax (all rows greedy, no
    penalty, grammar, logit bias, banned ids or logprobs; screened in bfloat16 when the lm_head is float32,
    params["lm_head_screen"], else `sampling.greedy_ids`: kernels/greedy_head under --sampling-backend pallas)
    and returns K = 0. "sample" applies everything and samples each row with its
    temperature (0: argmax), top-k, top-p and min-p; K = TOP_LOGPROBS_MAX, and the logprobs (of the raw
    logits, as SGLang reports them) are computed only when f.logprobs (`lax.cond`; zeros otherwise): one
    program instead of a second one with logprobs per batch size, which cost startup compile time. The
    sampled token's logprob is its raw logit recomputed from its lm_head row minus the logsumexp, equal to
    the [B, V] product's entry up to float32 summation order. A "sample" batch of more than SAMPLE_BLOCK_ROWS
    rows (a multiple of it) runs block by block (`lax.map`): the same rows, the same values."""
    b = last.shape[0]
    if kind == "greedy":
        none = (jnp.zeros(b, jnp.float32), jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32))
        screen = params.get("lm_head_screen")
        if screen is None:
            return (sampling.greedy_ids(last, lm_head_weight(params, config)), *none)
        return (greedy_screen.screened_greedy(last, lm_head_weight(params, config), screen), *none)
    if b > SAMPLE_BLOCK_ROWS and b % SAMPLE_BLOCK_ROWS == 0:
        n = b // SAMPLE_BLOCK_ROWS

        def blocks(x: jax.Array) -> jax.Array:
            return x.reshape(n, SAMPLE_BLOCK_ROWS, *x.shape[1:])

        out = jax.lax.map(lambda xs: _sample_rows(params, xs[0], xs[1], f, config=config),
                          (blocks(last), jax.tree.map(blocks, rp)))
        return tuple(y.reshape(b, *y.shape[2:]) for y in out)
    return _sample_rows(params, last, rp, f, config=config)


def _sample_rows(params, last, rp, f, *, config):
    """The "sample" kind of `_sample_program` over `last` [B, H] at once."""
    b = last.shape[0]
    weight = lm_head_weight(params, config)
    k = sampler.TOP_LOGPROBS_MAX
    # Only process_logits reads the [B, V] logits, so XLA updates them in place. The logprobs' statistics
    # come from a second product inside the cond and the sampled token's raw logit from its own lm_head row:
    # reading the raw logits after processing made XLA copy them in every step (32 MB at 32 rows, ~15% of
    # the step), logprobs or not.
    skipped = (jnp.zeros(b, jnp.float32), jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32))
    lse, top_lp, top_ids = jax.lax.cond(
        f.logprobs, lambda: sampler.raw_logprob_top(compute_logits(params, last, config=config), k), lambda: skipped)
    logits = compute_logits(params, last, config=config)
    tokens = sampler.sample(sampler.process_logits(logits, rp, f), rp, f)
    chosen = jnp.einsum("nh,nh->n", last, weight[tokens], preferred_element_type=jnp.float32)
    # min: the two sums round differently, and a near-certain token must not report a logprob above 0.
    lp = jnp.minimum(chosen - lse, 0.0)
    # A token among the top alternatives reports their value (its own row product rounds differently, ~1e-6):
    # one value per token, as SGLang's one logprobs tensor gives.
    hit = top_ids == tokens[:, None]
    lp = jnp.where(hit.any(axis=1), jnp.sum(jnp.where(hit, top_lp, 0.0), axis=1), lp)
    return tokens, jnp.where(f.logprobs, lp, 0.0), top_lp, top_ids


def _greedy_tokens(params, last, *, config, sampling: SamplingBackend):
    """The "greedy" sampling program's tokens [B] int32 of `last` [B, H] (speculative decoding's commit program
    samples an all-greedy verify step with it)."""
    return _sample_program(params, last, None, None, config=config, kind="greedy", sampling=sampling)[0]


def _prompt_logprobs(params, hidden, targets, *, config):
    """hidden [N, H], targets [N] -> (logprob [N], top_logprobs [N, K], top_ids [N, K]), K = TOP_LOGPROBS_MAX."""
    return sampler.token_logprobs(compute_logits(params, hidden, config=config), targets, sampler.TOP_LOGPROBS_MAX)
