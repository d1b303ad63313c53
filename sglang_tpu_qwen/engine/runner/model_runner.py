"""ModelRunner: owns the weights and the device cache, and runs the compiled step programs.

Every program the server runs is one of a fixed set (issue 12): a forward per `StepBucket`
(engine/runner/buckets.py), two sampling programs per batch size (greedy, sample; engine/runner/sampler.py),
one penalty-table and one keep-sampled program per batch size, the `head_rows` programs that take an
extend step's finishing rows, one prompt-logprob program, and the GDN slot copies.
`precompile()` builds them all before the server reports ready (from the persistent compilation cache when
it can, engine/runner/compilation.py); `lower_forward` / `lower_sample` give the `jax.stages.Lowered` of each from
abstract arguments with their shardings, for precompile and for the deviceless planner. The scheduler
hands host (numpy) arrays already padded to a bucket; a shape outside the set raises instead of compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner import compilation, greedy_screen, memory_accounting, sampler
from sglang_tpu_qwen.engine.runner.buckets import BucketSet, StepBucket, next_pow2
from sglang_tpu_qwen.engine.runner.device_idle import DeviceIdleMeter
from sglang_tpu_qwen.engine.runner.weight_loading import load_weights
from sglang_tpu_qwen.kernels.dispatch import resolve_backends
from sglang_tpu_qwen.memory import gdn_state, kv_io
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config
from sglang_tpu_qwen.model.forward import compute_logits, forward_step, init_cache, lm_head_weight
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.parallel.mesh import make_layout
from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs, param_pspecs

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 64  # positions per call of the prompt-logprob program
SampleKind = Literal["greedy", "sample"]
SAMPLE_KINDS: tuple[SampleKind, ...] = ("greedy", "sample")

__all__ = ["ModelRunner", "SamplingBatch", "SampleOutput", "StepOutput", "next_pow2", "resolve_dtype"]


def resolve_dtype(name: str) -> jnp.dtype:
    """Compute dtype from --dtype; `auto` is float32 on CPU (XLA:CPU bf16 matmuls are slow) else bfloat16."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    table = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name not in table:
        raise ValueError(f"--dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


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


@dataclass
class StepOutput:
    """Device result of one forward step: hidden [B, T, H] (prompt logprobs) and last [B, H], each row's
    hidden state at its last new token (sampling)."""

    hidden: jax.Array
    last: jax.Array
    decode: bool = False


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
    stats: StepStats | None = None  # decode steps: the blocked time is added here
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
        if self.stats is not None:
            self.stats.decode_wait_s += time.perf_counter() - start
            self.stats.decode_waits += 1
        return (np.asarray(toks), np.asarray(lp), np.asarray(top_lp)[:, : self.num_top],
                np.asarray(top_ids)[:, : self.num_top])


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings where the leaves have one) of arrays or ShapeDtypeStructs."""
    def one(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


class ModelRunner:
    """Weights, KV pages and GDN slots on device, and the compiled forward / sampling programs."""

    def __init__(self, model_path: str, args: ServerArgs, devices: list | None = None) -> None:
        """`devices`: where weights and cache live (the mesh's devices with --dp-size/--ep-size > 1, else the
        first one); default all devices / the default device."""
        compilation.install_counter()
        self.cache_dir = compilation.configure_persistent_cache(args.compilation_cache_dir)
        self.config: Qwen35MoeConfig = load_config(model_path)
        self.dtype = resolve_dtype(args.dtype)
        first = (devices or jax.devices())[0]
        args.resolve_chunked_prefill_size(jax.default_backend(), memory_accounting.device_memory_limit(first))
        if args.dp_size > 1:
            logger.info("--chunked-prefill-size %d is split over the %d DP ranks: %d prompt tokens per rank per step",
                        args.chunked_prefill_size, args.dp_size, args.chunked_prefill_per_rank)
        # Data-parallel attention + expert-parallel MoE (docs/internals.md, "parallel/"): one mesh; each DP rank owns
        # a contiguous block of num_pages pages and num_slots slots of the global cache.
        self.dp = args.dp_size
        self.layout = make_layout(args.dp_size, args.ep_size, args.tp_size, devices=devices) \
            if args.dp_size * args.ep_size > 1 else None
        # Without a mesh, an explicit device list pins the engine to its first device (committed arrays: every
        # program then runs there).
        self._device = devices[0] if devices and self.layout is None else None
        # Each tensor goes from the files straight into its final sharding (engine/runner/weight_loading.py).
        self.params = load_weights(model_path, self.config, self.dtype, args, self.layout, self._device)
        head = lm_head_weight(self.params, self.config)
        if head.dtype == jnp.float32:  # greedy steps read a bfloat16 screen of it (engine/runner/greedy_screen.py)
            self.params["lm_head_screen"] = jax.jit(greedy_screen.greedy_screen)(head)
        if self.layout is not None:
            logger.info("mesh %s: attention dp=%d over %s, experts ep=%d, MoE combine %s",
                        dict(self.layout.mesh.shape), self.dp, "+".join(self.layout.batch_axes), args.ep_size,
                        args.moe_combine)
        self.page_size = args.page_size
        self._size_slots(args)
        # The KV pool gets what the weights and the GDN slots leave (engine/runner/memory_accounting.py).
        state_dtype = jnp.float32
        self.cache_units = memory_accounting.cache_units(self.config, self.page_size, self.dtype, state_dtype)
        weight_bytes = memory_accounting.bytes_per_device(self.params)
        device = max(weight_bytes, key=weight_bytes.__getitem__)
        max_tokens = args.max_total_tokens or memory_accounting.kv_pool_tokens(
            device, args.mem_fraction_static, weight_bytes[device], self.num_slots, self.cache_units)
        # Per DP rank (with dp = 1: the whole pool). Page 0 / slot 0 of each rank are its trash targets.
        self.num_pages = max_tokens // self.page_size + 1
        make_cache = partial(init_cache, self.config, self.dp * self.num_pages, self.page_size,
                             self.dp * self.num_slots, self.dtype, state_dtype)
        # Zeros created in their sharding (no device holds the global cache), committed like the caches the
        # compiled steps return: eager slot copies then see one signature.
        if self.layout is not None:
            cache_sh: Any = {k: NamedSharding(self.layout.mesh, p) for k, p in cache_pspecs(self.layout).items()}
        else:
            cache_sh = SingleDeviceSharding(self._device or jax.devices()[0])
        self.cache = jax.jit(make_cache, out_shardings=cache_sh)()
        self.memory_usage = memory_accounting.memory_usage(self.params, self.cache,
                                                           (self.num_pages - 1) * self.page_size)
        logger.info("KV pool: %d pages x %d tokens; GDN slots: %d running + %d snapshots%s", self.num_pages - 1,
                    self.page_size, self.num_running_slots - 1, self.num_snapshot_slots,
                    f" (each of {self.dp} DP ranks)" if self.dp > 1 else "")
        self.backends = resolve_backends(args.attention_backend, args.gdn_backend, config=self.config)
        logger.info("kernels: attention %s, gdn %s%s", self.backends.attention, self.backends.gdn,
                    " (Pallas interpret mode)" if self.backends.interpret else "")
        self._build_buckets(args)
        self.debug_nan_fill = args.debug_nan_fill_freed_slots
        self.has_prefix_cache = self.num_snapshot_slots > 0
        self.host_snapshot_tier = args.gdn_snapshot_host_gb > 0
        self.moe_combine = args.moe_combine
        self._build_programs()

    # ---- program construction ------------------------------------------------------------------
    def _size_slots(self, args: ServerArgs) -> None:
        """GDN slots per DP rank from the flags (the planner's abstract runner sizes them here too).

        Slot ids within a rank: 0 trash, [1, R] running requests, (R, R + S] prefix-cache snapshots.
        """
        self.max_running_per_rank = -(-args.max_running_requests // self.dp)
        self.num_running_slots = self.max_running_per_rank + 1
        if args.disable_radix_cache or not self.config.num_gdn_layers:
            self.num_snapshot_slots = 0
        else:
            default = 2 * self.max_running_per_rank
            self.num_snapshot_slots = default if args.max_gdn_snapshots is None else args.max_gdn_snapshots
        self.num_slots = self.num_running_slots + self.num_snapshot_slots

    def _build_buckets(self, args: ServerArgs) -> None:
        """The compiled step shapes (engine/runner/buckets.py) for this runner's pool; needs num_pages set."""
        self.context_length = args.context_length or self.config.max_position_embeddings
        self.buckets = BucketSet.build(
            max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_per_rank,
            context_length=self.context_length, kv_tokens=(self.num_pages - 1) * self.page_size,
            page_size=self.page_size, dp=self.dp, bs_paddings=args.precompile_bs_paddings,
            token_paddings=args.precompile_token_paddings)

    def _build_programs(self) -> None:
        """The jitted functions behind every program; nothing is compiled here."""
        step = partial(forward_step, backends=self.backends)
        if self.layout is None:
            fwd = partial(step, config=self.config)
            last = _last_rows
        else:
            fwd = make_sharded_forward(self.layout, self.config, self.params, combine=self.moe_combine,
                                       forward=step)
            rows = batch_pspec(self.layout)
            last = jax.shard_map(_last_rows, mesh=self.layout.mesh, in_specs=(rows, rows), out_specs=rows,
                                 check_vma=False)

        # A compiled call costs scheduler-thread time per argument leaf (flattening, signature and layout
        # checks, one host-to-device copy per host array): the programs take the parameters as their flat
        # list of leaves (flattened once here, not a nested dict every step) and a step's host arrays as one.
        self._param_leaves, param_def = jax.tree.flatten(self.params)
        pages = self.buckets.pages

        def forward_program(param_leaves, cache, packed, prev_tokens):
            params = jax.tree.unflatten(param_def, param_leaves)
            tokens, prefix_lens, new_lens, page_table, slot_ids, token_src = _unpack_step(packed, pages)
            tokens = _take_prev_tokens(tokens, prev_tokens, token_src)  # overlap: last step's ids stay on device
            hidden, cache = fwd(params, cache, ForwardBatch.of(tokens, prefix_lens, new_lens, page_table, slot_ids))
            return hidden, last(hidden, jnp.maximum(new_lens - 1, 0)), cache

        self._forward_jit = jax.jit(forward_program, donate_argnums=(1,))
        # Same for sampling: the head parameters as their leaves, the Features flags as one bool array.
        self._head_leaves, head_def = jax.tree.flatten(self._head_params())

        def sample_program(head_leaves, last, rp, flags, *, kind):
            per_rank = self._per_rank(partial(_sample_program, config=self.config, kind=kind))
            return per_rank(jax.tree.unflatten(head_def, head_leaves), last, rp, sampler.Features(*flags))

        self._sample_jits = {kind: jax.jit(partial(sample_program, kind=kind)) for kind in SAMPLE_KINDS}
        # Not donated: the first call reads the resident zero table of _unused_inputs.
        self._penalty_jit = jax.jit(sampler.penalty_update,
                                    out_shardings=None if self.layout is None else self._row_sharding(2))
        self._prompt_lp_jit = jax.jit(partial(_prompt_logprobs, config=self.config))
        # Overlap scheduling: the sampled ids of a step, padded to prev_rows, feed the next step's forward.
        self.prev_rows = max(self.buckets.sample_batches())
        self._keep_sampled_jit = jax.jit(partial(_pad_rows, rows=self.prev_rows), out_shardings=self._replicated())
        self._head_rows_jit = jax.jit(_head_rows, static_argnames="rows")
        self._prev_tokens: jax.Array | None = None  # made on first use (the planner builds programs abstractly)
        self._programs: dict[tuple, Any] = {}
        self._unused: dict[int, sampler.RowParams] = {}  # per B: device arrays of "feature unused" inputs
        self._flags: dict[tuple[bool, ...], jax.Array] = {}  # resident Features arrays
        self._ready = False
        self.stats = StepStats()
        self._last_decode_start: float | None = None
        self.idle_meter: DeviceIdleMeter | None = None  # set by benchmarks: device idle between decode steps

    def _batch_sharding(self, ndim: int = 1) -> Any:
        """Where a host array of per-row values goes: split by rows over the DP ranks, or the one device."""
        if self.layout is None:
            return SingleDeviceSharding(self._device or jax.devices()[0])
        return self._row_sharding(ndim)

    def _row_sharding(self, ndim: int) -> NamedSharding:
        assert self.layout is not None
        spec = batch_pspec(self.layout)
        return NamedSharding(self.layout.mesh, P(*spec, *([None] * (ndim - len(spec)))))

    def _replicated(self) -> Any:
        if self.layout is None:
            return SingleDeviceSharding(self._device or jax.devices()[0])
        return NamedSharding(self.layout.mesh, P())

    def _spec(self, shape: tuple[int, ...], dtype: Any, replicated: bool = False) -> jax.ShapeDtypeStruct:
        sharding = self._replicated() if replicated else self._batch_sharding(len(shape))
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    def _row_param_specs(self, b: int) -> sampler.RowParams:
        v = self.config.vocab_size
        f32, i32 = jnp.float32, jnp.int32
        s = self._spec
        return sampler.RowParams(
            temperature=s((b,), f32), top_p=s((b,), f32), top_k=s((b,), i32), min_p=s((b,), f32),
            seeds=s((b,), jnp.uint32), steps=s((b,), i32), repetition=s((b,), f32), frequency=s((b,), f32),
            presence=s((b,), f32), penalty_table=s((b, v), i32), bias_ids=s((b, sampler.LOGIT_BIAS_WIDTH), i32),
            bias_vals=s((b, sampler.LOGIT_BIAS_WIDTH), f32), ban_ids=s((b, sampler.BAN_WIDTH), i32),
            bitmask=s((b, -(-v // 32)), i32))

    def _feature_specs(self) -> jax.ShapeDtypeStruct:
        return self._spec((len(sampler.Features._fields),), jnp.bool_, replicated=True)

    def lower_forward(self, bucket: StepBucket) -> jax.stages.Lowered:
        """The forward program of `bucket` lowered from abstract arguments (the parameter leaves, cache and
        the step's packed host array with their shardings): input packed [B, T + 4 + P] int32 (`_pack_step`:
        tokens [B, T], prefix_lens, new_lens, slot_ids, token_src [B], page_table [B, P]) and the kept
        sampled ids [prev_rows]; outputs (hidden [B, T, H], last [B, H], cache)."""
        b, t, p = bucket.batch, bucket.tokens, bucket.pages
        i32 = jnp.int32
        return self._forward_jit.lower(
            _abstract(self._param_leaves), _abstract(self.cache), self._spec((b, t + _STEP_COLUMNS + p), i32),
            self._spec((self.prev_rows,), i32, replicated=True))

    def lower_sample(self, kind: SampleKind, batch: int) -> jax.stages.Lowered:
        """Sampling program `kind` for B = `batch` rows: (leaves of _head_params(), last [B, H], RowParams,
        Features as one replicated bool array [len(Features._fields)]) -> (tokens [B], logprob [B],
        top_logprobs [B, K], top_ids [B, K]); K = TOP_LOGPROBS_MAX for "sample", 0 for "greedy"."""
        h = self.config.hidden_size
        return self._sample_jits[kind].lower(
            _abstract(self._head_leaves), self._spec((batch, h), self.dtype), self._row_param_specs(batch),
            self._feature_specs())

    def _lower_penalty(self, batch: int) -> jax.stages.Lowered:
        chunk = self._spec((batch, sampler.PENALTY_CHUNK), jnp.int32)
        return self._penalty_jit.lower(self._spec((batch, self.config.vocab_size), jnp.int32), chunk, chunk)

    def _lower_prompt_logprobs(self) -> jax.stages.Lowered:
        n, h = PROMPT_LOGPROB_ROWS, self.config.hidden_size
        return self._prompt_lp_jit.lower(_abstract(self._head_params()),
                                         self._spec((n, h), self.dtype, replicated=True),
                                         self._spec((n,), jnp.int32, replicated=True))

    def program_keys(self) -> list[tuple]:
        """Every program of the fixed set, as the keys `_program` takes."""
        keys: list[tuple] = [("forward", bk) for bk in self.buckets.step_buckets()]
        for b in self.buckets.sample_batches():
            keys += [("sample", kind, b) for kind in SAMPLE_KINDS]
            keys.append(("penalty", b))
            keys.append(("keep_sampled", b))
        keys += [("head_rows", big, b) for big, b in self.buckets.head_rows_pairs()]
        keys.append(("prompt_logprobs",))
        return keys

    def _lower(self, key: tuple) -> jax.stages.Lowered:
        if key[0] == "forward":
            return self.lower_forward(key[1])
        if key[0] == "sample":
            return self.lower_sample(key[1], key[2])
        if key[0] == "penalty":
            return self._lower_penalty(key[1])
        if key[0] == "prompt_logprobs":
            return self._lower_prompt_logprobs()
        if key[0] == "keep_sampled":
            return self._keep_sampled_jit.lower(self._spec((key[1],), jnp.int32))
        if key[0] == "head_rows":
            return self._head_rows_jit.lower(self._spec((key[1], self.config.hidden_size), self.dtype), rows=key[2])
        raise KeyError(key)

    def _program(self, key: tuple) -> Any:
        """The compiled program `key` (compiled now when precompile was skipped or did not cover it)."""
        prog = self._programs.get(key)
        if prog is None:
            if key not in self._program_key_set():
                raise ValueError(f"program {key} is outside the compiled set (engine/runner/buckets.py)")
            if self._ready:
                logger.error("compiling %s after the server was ready", key)
            else:
                logger.info("compiling %s (deferred: --disable-precompile)", key)
            prog = self._programs[key] = self._lower(key).compile()
        return prog

    def _program_key_set(self) -> set[tuple]:
        if not hasattr(self, "_key_set"):
            self._key_set = set(self.program_keys())
        return self._key_set

    def precompile(self, progress: bool = True) -> dict[str, Any]:
        """Compile (or load from the persistent cache) every program of the fixed set, then the GDN slot
        copies the prefix cache uses; afterwards a compilation is logged as an error.

        Returns {"programs", "from_cache", "compiled", "seconds"}. Shows a tqdm bar when `progress`.
        """
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        keys = [k for k in self.program_keys() if k not in self._programs]
        start = time.perf_counter()
        hits0, comps0 = compilation.cache_hits(), compilation.jit_compilations()
        # Lower here (tracing holds the GIL), compile on every core (XLA releases it).
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool, \
                tqdm(total=len(keys), desc="precompile", unit="program", disable=not progress) as bar:
            futures = {pool.submit(self._lower(key).compile): key for key in keys}
            for fut in as_completed(futures):
                self._programs[futures[fut]] = fut.result()
                bar.update(1)
        for b in self.buckets.sample_batches():
            self._unused_inputs(b)
        self._run_every_program_once()
        self._precompile_slot_copies()
        stats = {"programs": compilation.jit_compilations() - comps0,
                 "from_cache": compilation.cache_hits() - hits0,
                 "seconds": time.perf_counter() - start}
        stats["compiled"] = stats["programs"] - stats["from_cache"]
        # The bar counts the step and sampling programs; the small input and GDN slot-copy programs follow it.
        logger.info("precompiled %d programs in %.1f s (%d from the persistent cache %s, %d compiled; %d step and "
                    "sampling programs, %d input and slot-copy programs): %d forward buckets %s, sampling batch "
                    "sizes %s", stats["programs"], stats["seconds"], stats["from_cache"], self.cache_dir or "(off)",
                    stats["compiled"], len(keys), stats["programs"] - len(keys),
                    len(self.buckets.step_buckets()), _bucket_summary(self.buckets),
                    self.buckets.sample_batches())
        self._ready = True
        compilation.arm()
        return stats

    def _run_every_program_once(self) -> None:
        """Execute each step and sampling program once on padding rows (trash page 0 and slot 0, nothing
        sampled for a request): XLA:CPU initialises an executable on its first run (~30 ms measured per
        program), which would otherwise land on the first request of each shape."""
        pages = self.buckets.pages
        outs: dict[int, StepOutput] = {}
        extend_outs: dict[int, StepOutput] = {}
        for bucket in self.buckets.step_buckets():
            b, zeros = bucket.batch, np.zeros(bucket.batch, np.int32)
            out = self.forward(np.zeros((b, bucket.tokens), np.int32), zeros, zeros, np.zeros((b, pages), np.int32),
                               zeros)
            (outs if bucket.mode == "decode" else extend_outs)[b] = out
        for big, b in self.buckets.head_rows_pairs():
            self._program(("head_rows", big, b))(extend_outs[big].last)
        for b in self.buckets.sample_batches():
            f32 = np.zeros(b, np.float32)
            none = np.full((b, 1), -1, np.int32)
            base = SamplingBatch(f32, np.ones(b, np.float32), np.zeros(b, np.int32), f32, np.zeros(b, np.uint32),
                                 np.zeros(b, np.int32), np.ones(b, np.float32), f32, f32, None, None, none, False, 0)
            for batch in (base, dataclasses.replace(base, temperature=np.ones(b, np.float32), seen_ids=none,
                                                    output_ids=none),
                          dataclasses.replace(base, want_logprobs=True)):
                self.keep_sampled(self.sample(outs[b], batch))
        first = next(iter(outs.values()))
        one = np.zeros(1, np.int32)
        self.logprobs_at(first, one, one, one, 0)
        jax.block_until_ready(self.cache)
        self._last_decode_start = None
        self.stats.reset()

    def _precompile_slot_copies(self) -> None:
        """The prefix cache copies GDN slots in groups padded to powers of two (memory/gdn_state.py): run each
        size once on trash slot 0 (a copy onto itself) so its program exists before serving."""
        if not self.has_prefix_cache:
            return
        # The copies are plain jit calls keyed on the cache's sharding, which may differ between a cache from
        # a step program and one from a copy (meshes): the cache here comes from a step program
        # (_run_every_program_once runs first); every size twice, so both inputs are seen.
        sizes = [1 << i for i in range(next_pow2(self.buckets.max_decode_rows).bit_length())]
        for n in sizes + sizes:
            self.cache = gdn_state.copy_slots(self.cache, [(0, 0)] * n)
        if self.host_snapshot_tier:  # demotion to host memory and restore from it
            self.cache = gdn_state.write_slot(self.cache, 0, *gdn_state.read_slot(self.cache, 0))

    def _unused_inputs(self, b: int) -> sampler.RowParams:
        """Device arrays meaning "unused" for the optional inputs of a B-row sampling program, kept resident
        so a step that uses no penalty / bias / grammar copies nothing for them."""
        cached = self._unused.get(b)
        if cached is None:
            v = self.config.vocab_size
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
            arrays = {k: jax.device_put(a, self._batch_sharding(a.ndim)) for k, a in host.items()}
            cached = self._unused[b] = sampler.RowParams(**arrays)
        return cached

    def _features(self, flags: tuple[bool, ...]) -> jax.Array:
        """sampler.Features as a resident replicated bool array, one per combination seen: no host-to-device
        copy per step."""
        arr = self._flags.get(flags)
        if arr is None:
            arr = self._flags[flags] = jax.device_put(np.asarray(flags, np.bool_), self._replicated())
        return arr

    def _head_params(self) -> dict[str, Any]:
        """The parameters the sampling and prompt-logprob programs read: the output projection (`lm_head`, or
        `embed` when tied) and its bfloat16 screen. Not the whole tree: a compiled call costs dispatch time
        per argument leaf on the scheduler thread (~0.5 ms per step for ~120 leaves on the 2-core CPU)."""
        keys = ["embed" if self.config.tie_word_embeddings else "lm_head", "lm_head_screen"]
        return {k: self.params[k] for k in keys if k in self.params}

    def _per_rank(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(params, last, row_params, features)` run by each DP rank on its own rows.

        Without a mesh, fn itself. With one, a `shard_map` over the batch axes: rows are independent
        (per-row seeds), so each device samples the rows it computed and no data crosses devices (a
        global-batch jit would let XLA insert collectives for nothing). Features are replicated scalars.
        """
        if self.layout is None:
            return fn
        layout = self.layout
        pspecs = param_pspecs(self._head_params(), layout)
        rows = batch_pspec(layout)

        def run(params: Any, last: jax.Array, rp: sampler.RowParams, feats: sampler.Features) -> Any:
            rp_specs = sampler.RowParams(*([rows] * len(sampler.RowParams._fields)))
            f_specs = sampler.Features(*([P()] * len(sampler.Features._fields)))
            return jax.shard_map(fn, mesh=layout.mesh, in_specs=(pspecs, rows, rp_specs, f_specs),
                                 out_specs=rows, check_vma=False)(params, last, rp, feats)

        return run

    def close(self) -> None:
        """The engine shuts down: stop treating compilations as errors on its behalf."""
        if self._ready:
            self._ready = False
            compilation.disarm()

    def page_base(self, rank: int) -> int:
        """Global id of DP rank `rank`'s trash page; its usable pages are the next num_pages - 1 ids."""
        return rank * self.num_pages

    def slot_base(self, rank: int) -> int:
        """Global id of DP rank `rank`'s trash slot; running slots follow, then snapshot slots."""
        return rank * self.num_slots

    def _to_rank_local(self, ids: np.ndarray, per_rank: int) -> np.ndarray:
        """Global page/slot ids [B, ...] -> the ids each rank's shard uses (row block r minus r * per_rank).

        Rank r owns rows [r*B/dp, (r+1)*B/dp); 0 (padding: the trash target) stays 0.
        """
        if self.dp == 1:
            return ids
        b = ids.shape[0]
        base = (np.arange(b) // (b // self.dp)) * per_rank
        base = base.reshape((b,) + (1,) * (ids.ndim - 1))
        local = np.where(ids > 0, ids - base, 0).astype(np.int32)
        if np.any(local < 0) or np.any(local >= per_rank):
            raise AssertionError("a row uses a page or slot of another DP rank")
        return local

    def _put(self, arrays: list[np.ndarray], replicated: bool = False) -> list[jax.Array | np.ndarray]:
        """Host arrays as the compiled programs take them: on one device the arrays themselves (the compiled
        call transfers them in C++; `jax.device_put` cost ~0.2 ms of Python per array, ~4 ms of host time per
        128-row step), with a mesh device arrays with the programs' shardings (one transfer call)."""
        if self.layout is None:
            return [np.asarray(a) for a in arrays]
        shardings = [self._replicated() if replicated else self._batch_sharding(np.ndim(a)) for a in arrays]
        return jax.device_put(arrays, shardings)

    # ---- cache state operations (the only code that replaces self.cache besides forward) -------------
    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the GDN state of slot src into slot dst for each (src, dst) pair (global slot ids)."""
        self.cache = gdn_state.copy_slots(self.cache, pairs)

    def fill_nan_slots(self, slots: list[int]) -> None:
        """Poison freed GDN slots with NaN (--debug-nan-fill-freed-slots)."""
        self.cache = gdn_state.fill_nan(self.cache, slots)

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's GDN state (conv [n_gdn, conv_dim, K-1], rec [n_gdn, Hv, dk, dv])."""
        return gdn_state.read_slot(self.cache, slot)

    def write_slot(self, slot: int, conv: np.ndarray, rec: np.ndarray) -> None:
        """Upload a host copy (from read_slot) into a slot."""
        self.cache = gdn_state.write_slot(self.cache, slot, conv, rec)

    def gather_kv(self, pages: list[int], start: int, end: int) -> tuple[jax.Array, jax.Array]:
        """Token-major KV of positions [start, end) of a sequence with page table `pages` (kv_io.gather_kv)."""
        return kv_io.gather_kv(self.cache, pages, self.page_size, start, end)

    def read_gdn(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """Device copies of one slot's GDN state (kv_io.read_gdn)."""
        return kv_io.read_gdn(self.cache, slot)

    def write_state(self, pages: list[int], k: Any, v: Any, slot: int, conv: Any, rec: Any) -> None:
        """Write a transferred request's token-major KV into `pages` and its GDN state into `slot`."""
        self.cache = kv_io.write_kv(self.cache, pages, k, v)
        self.cache = kv_io.write_gdn(self.cache, slot, conv, rec)

    def input_placement(self) -> jax.sharding.Sharding:
        """Where arrays given to write_state should live (replicated over the cache's devices)."""
        return kv_io.input_placement(self.cache)

    # ---- steps ---------------------------------------------------------------------------------
    def forward(
        self, tokens: np.ndarray, prefix_lens: np.ndarray, new_lens: np.ndarray, page_table: np.ndarray,
        slot_ids: np.ndarray, token_src: np.ndarray | None = None,
    ) -> StepOutput:
        """Run one step on host arrays padded to a bucket; returns device arrays (does not wait).

        tokens [B, T] int32; prefix_lens, new_lens, slot_ids [B] int32; page_table [B, P] int32 with
        (B, T, P) one of `self.buckets` (ValueError otherwise). Page and slot ids are global; with dp > 1
        rows [r*B/dp, (r+1)*B/dp) must use rank r's ids only (AssertionError otherwise).
        token_src [B] int32 (overlap scheduling): where >= 0, row b's first token is row token_src[b] of the
        ids the last `keep_sampled` call kept on the device (tokens[b, 0] is ignored); -1 or None: host tokens.
        """
        b, t = tokens.shape
        bucket = StepBucket("decode" if t == 1 else "extend", b, t, page_table.shape[1])
        prog = self._program(("forward", bucket))
        now = time.perf_counter()
        follows_decode = t == 1 and self._last_decode_start is not None
        if follows_decode:
            self.stats.decode_steps += 1
            self.stats.decode_wall_s += now - self._last_decode_start
        self._last_decode_start = now if t == 1 else None
        packed = _pack_step(tokens, prefix_lens, new_lens, self._to_rank_local(page_table, self.num_pages),
                            self._to_rank_local(slot_ids, self.num_slots), token_src)
        if self._prev_tokens is None:
            self._prev_tokens = jax.device_put(np.zeros(self.prev_rows, np.int32), self._replicated())
        hidden, last, self.cache = prog(self._param_leaves, self.cache, self._put([packed])[0], self._prev_tokens)
        if self.idle_meter is not None:  # stamped once the call returned: the program is enqueued by then
            if follows_decode:
                self.idle_meter.dispatched(time.perf_counter())
            else:
                self.idle_meter.break_pair()
        return StepOutput(hidden, last, decode=t == 1)

    def keep_sampled(self, out: SampleOutput) -> None:
        """Keep out.tokens [B] on the device as the ids the next forward's token_src rows read (overlap
        scheduling: no host round trip between a step's sampling and the next step's input)."""
        self._prev_tokens = self._program(("keep_sampled", out.tokens.shape[0]))(out.tokens)

    def sample(self, step: StepOutput, batch: SamplingBatch) -> SampleOutput:
        """Sample one token per row of `batch` (B rows) from step.last; returns device arrays without waiting
        (`.get()` reads). B below the step's rows samples its first B rows (a `head_rows` program).

        Runs the greedy program when every row is greedy and none wants logprobs, a penalty or a grammar,
        else the sample program (which computes logprobs when a row wants them). Raises ValueError when a
        width exceeds its bound (num_top_logprobs > TOP_LOGPROBS_MAX, more than BAN_WIDTH bans or
        LOGIT_BIAS_WIDTH bias entries).
        """
        b = batch.temperature.shape[0]
        last = step.last
        if last.shape[0] != b:  # an extend step's finishing rows, rows [0, b) (ScheduleBatch.build)
            last = self._program(("head_rows", last.shape[0], b))(last)
        if batch.num_top_logprobs > sampler.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs_num {batch.num_top_logprobs} > {sampler.TOP_LOGPROBS_MAX}")
        sampling = batch.temperature > 0.0
        use_bias = batch.bias_ids is not None and bool((batch.bias_ids >= 0).any())
        use_bans = bool((batch.banned_ids >= 0).any())
        use_grammar = batch.token_bitmask is not None
        use_penalty = batch.seen_ids is not None
        any_sampling = bool(sampling.any())
        greedy = not (any_sampling or use_grammar or use_penalty)
        kind: SampleKind = "greedy" if greedy and not batch.want_logprobs else "sample"
        filters = (False,) * 4 if not any_sampling else (  # the per-row filters apply to sampling rows only
            bool(np.any(sampling & (batch.top_k > 0))), bool(np.any(sampling & (batch.top_k > sampler.TOP_K_BOUND))),
            bool(np.any(sampling & (batch.top_p < 1.0))), bool(np.any(sampling & (batch.min_p > 0.0))))
        feats = self._features((use_grammar, use_penalty, use_bias, *filters, batch.want_logprobs))
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
        put = self._put(rows + list(optional.values()))
        fields = dict(zip(sampler.RowParams._fields[: len(rows)], put[: len(rows)], strict=True))
        fields.update(zip(optional, put[len(rows):], strict=True))
        if use_penalty:
            fields["penalty_table"] = self._penalty_table(b, batch)
        # The inputs this step does not set stay the resident "unused" arrays.
        row_params = self._unused_inputs(b)._replace(**fields)
        out = self._program(("sample", kind, b))(self._head_leaves, last, row_params, feats)
        if step.decode and self.idle_meter is not None:
            self.idle_meter.watch(out[0])
        return SampleOutput(*out, num_top=batch.num_top_logprobs if batch.want_logprobs else 0,
                            stats=self.stats if step.decode else None, has_logprobs=batch.want_logprobs)

    def time_decode_step(self, rows: int, context: int, iters: int = 20, windows: int = 3) -> float:
        """Device seconds per greedy decode step (forward, sampling and keep_sampled programs, input tokens
        read on the device as under overlap scheduling) of `rows` rows at `context` tokens each: the median
        over `windows` windows of `iters` steps dispatched back to back with one wait at the end, so host
        dispatch overlaps the device. For benchmarks on an IDLE engine only: rows read arbitrary pages and
        write position context - 1 into the trash page and trash slot."""
        bucket = self.buckets.decode_bucket(-(-rows // self.dp))
        b, pages = bucket.batch, bucket.pages
        ps = self.page_size
        usable = self.num_pages - 1
        page_table = (1 + (np.arange(b * pages).reshape(b, pages) % usable)).astype(np.int32)
        page_table[:, (context - 1) // ps] = 0
        if self.dp > 1:
            page_table += (np.arange(b) // (b // self.dp))[:, None] * self.num_pages
            page_table[:, (context - 1) // ps] = (np.arange(b) // (b // self.dp)) * self.num_pages
        slots = ((np.arange(b) // (b // self.dp)) * self.num_slots).astype(np.int32)
        zeros_f = np.zeros(b, np.float32)
        batch = SamplingBatch(zeros_f, np.ones(b, np.float32), np.zeros(b, np.int32), zeros_f,
                              np.zeros(b, np.uint32), np.zeros(b, np.int32), np.ones(b, np.float32), zeros_f,
                              zeros_f, None, None, np.full((b, 4), -1, np.int32), False, 0)
        args = (np.zeros((b, 1), np.int32), np.full(b, context - 1, np.int32), np.ones(b, np.int32), page_table,
                slots)
        # As an overlapped decode step: each row's input token is the previous step's sampled id, kept on
        # the device by keep_sampled.
        token_src = np.arange(b, dtype=np.int32)
        saved = self._last_decode_start, dataclasses.replace(self.stats), self._prev_tokens, self.idle_meter
        self.idle_meter = None

        def step() -> SampleOutput:
            out = self.sample(self.forward(*args, token_src), batch)
            self.keep_sampled(out)
            return out

        for _ in range(2):
            step().tokens.block_until_ready()
        times = []
        for _ in range(windows):
            start = time.perf_counter()
            for _ in range(iters):
                out = step()
            out.tokens.block_until_ready()
            times.append((time.perf_counter() - start) / iters)
        self._last_decode_start, self.stats, self._prev_tokens, self.idle_meter = saved
        return float(np.median(times))

    def _penalty_table(self, b: int, batch: SamplingBatch) -> jax.Array:
        """[B, V] int32 penalty table from the host's id lists, PENALTY_CHUNK ids per program call."""
        assert batch.seen_ids is not None and batch.output_ids is not None
        table = self._unused_inputs(b).penalty_table
        prog = self._program(("penalty", b))
        c = sampler.PENALTY_CHUNK
        none = np.full((b, c), -1, np.int32)
        for phase, ids in enumerate((batch.seen_ids, batch.output_ids)):  # every seen chunk first
            for start in range(0, max(ids.shape[1], 1), c):
                chunk = _pad_cols(ids[:, start : start + c], c, -1, "ids")
                if start and not np.any(chunk >= 0):
                    break
                table = prog(table, *self._put([none, chunk] if phase else [chunk, none]))
        return table

    def logprobs_at(
        self, step: StepOutput, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray, num_top: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Logprob of targets[i] predicted at step.hidden[rows[i], cols[i]] (prompt logprobs).

        rows, cols, targets: [N] int32; num_top <= TOP_LOGPROBS_MAX. Returns (logprob [N],
        top_logprobs [N, num_top], top_ids [N, num_top]). The picked hidden rows go through the host (prompt
        logprobs only), then PROMPT_LOGPROB_ROWS at a time through one fixed program.
        """
        if num_top > sampler.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs_num {num_top} > {sampler.TOP_LOGPROBS_MAX}")
        picked = np.asarray(jax.device_get(step.hidden))[rows, cols]
        prog = self._program(("prompt_logprobs",))
        n, m = len(rows), PROMPT_LOGPROB_ROWS
        lps, tops, ids = [], [], []
        head = self._head_params()
        for start in range(0, n, m):
            h = picked[start : start + m]
            tgt = targets[start : start + m].astype(np.int32)
            pad = m - len(h)
            h = np.pad(h, ((0, pad), (0, 0)))
            tgt = np.pad(tgt, (0, pad))
            lp, top_lp, top_ids = jax.device_get(prog(head, *self._put([h, tgt], replicated=True)))
            lps.append(np.asarray(lp)[: m - pad])
            tops.append(np.asarray(top_lp)[: m - pad, :num_top])
            ids.append(np.asarray(top_ids)[: m - pad, :num_top])
        return np.concatenate(lps), np.concatenate(tops), np.concatenate(ids)


def _pad_cols(a: np.ndarray, width: int, fill: Any, what: str) -> np.ndarray:
    """[B, w] -> [B, width] padded with `fill`; ValueError when w > width."""
    if a.shape[1] > width:
        raise ValueError(f"{a.shape[1]} {what} in one row; at most {width}")
    out = np.full((a.shape[0], width), fill, a.dtype)  # not np.pad: ~20 us of Python per call, every step
    out[:, : a.shape[1]] = a
    return out


def _bucket_summary(buckets: BucketSet) -> str:
    return (f"(batch {list(buckets.batch_sizes)} x dp {buckets.dp}, extend tokens {list(buckets.token_sizes)} "
            f"for one row or the most rows within {buckets.extend_budget} tokens, page table {buckets.pages} columns)")


def _last_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden [B, T, H], index [B] -> [B, H]: each row's hidden state at its last new token."""
    return hidden[jnp.arange(hidden.shape[0]), index]


_STEP_COLUMNS = 4  # the [B] columns of a packed step between tokens and page_table


def _pack_step(tokens: np.ndarray, prefix_lens: np.ndarray, new_lens: np.ndarray, page_table: np.ndarray,
               slot_ids: np.ndarray, token_src: np.ndarray | None) -> np.ndarray:
    """A step's host arrays as one [B, T + 4 + P] int32 array: columns tokens [T], prefix_lens, new_lens,
    slot_ids, token_src (-1 where None), page_table [P]. One host-to-device copy instead of six."""
    b, t = tokens.shape
    packed = np.empty((b, t + _STEP_COLUMNS + page_table.shape[1]), np.int32)
    packed[:, :t] = tokens
    packed[:, t] = prefix_lens
    packed[:, t + 1] = new_lens
    packed[:, t + 2] = slot_ids
    packed[:, t + 3] = -1 if token_src is None else token_src
    packed[:, t + _STEP_COLUMNS:] = page_table
    return packed


def _unpack_step(packed: jax.Array, pages: int) -> tuple[jax.Array, ...]:
    """Inverse of `_pack_step` inside a program (P = `pages`): (tokens [B, T], prefix_lens, new_lens,
    page_table [B, P], slot_ids, token_src)."""
    t = packed.shape[1] - _STEP_COLUMNS - pages
    col = partial(jax.lax.index_in_dim, packed, axis=1, keepdims=False)
    return packed[:, :t], col(t), col(t + 1), packed[:, t + _STEP_COLUMNS:], col(t + 2), col(t + 3)


def _take_prev_tokens(tokens: jax.Array, prev: jax.Array, src: jax.Array) -> jax.Array:
    """tokens [B, T] with column 0 of each row where src [B] >= 0 replaced by prev[src] (prev [R] int32)."""
    first = jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], tokens[:, 0])
    return tokens.at[:, 0].set(first)


def _head_rows(last: jax.Array, *, rows: int) -> jax.Array:
    """last [B, H] -> its first `rows` rows [rows, H]."""
    return last[:rows]


def _pad_rows(tokens: jax.Array, *, rows: int) -> jax.Array:
    """tokens [B] int32 -> [rows] (zeros after B)."""
    return jnp.zeros(rows, jnp.int32).at[: tokens.shape[0]].set(tokens.astype(jnp.int32))


def _sample_program(params, last, rp, f, *, config, kind):
    """One sampling program (params: ModelRunner._head_params()): logits of `last` [B, H] -> (tokens [B]
    int32, logprob [B], top_logprobs [B, K], top_ids [B, K]). "greedy" takes the argmax after bias and bans
    (all rows greedy, no penalty, no grammar, no logprobs; screened in bfloat16 when the lm_head is float32,
    params["lm_head_screen"]) and returns K = 0. "sample" applies everything and samples each row with its
    temperature (0: argmax), top-k, top-p and min-p; K = TOP_LOGPROBS_MAX, and the logprobs (of the raw
    logits, as SGLang reports them) are computed only when f.logprobs (`lax.cond`; zeros otherwise): one
    program instead of a second one with logprobs per batch size, which cost startup compile time. The
    sampled token's logprob is its raw logit recomputed from its lm_head row minus the logsumexp, equal to
    the [B, V] product's entry up to float32 summation order."""
    b = last.shape[0]
    if kind == "greedy":
        none = (jnp.zeros(b, jnp.float32), jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32))
        screen = params.get("lm_head_screen")
        if screen is None:
            return (sampler.greedy_tokens(compute_logits(params, last, config=config), rp), *none)
        return (greedy_screen.screened_greedy(last, lm_head_weight(params, config), screen, rp, f), *none)
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
    return tokens, jnp.where(f.logprobs, jnp.minimum(chosen - lse, 0.0), 0.0), top_lp, top_ids


def _prompt_logprobs(params, hidden, targets, *, config):
    """hidden [N, H], targets [N] -> (logprob [N], top_logprobs [N, K], top_ids [N, K]), K = TOP_LOGPROBS_MAX."""
    return sampler.token_logprobs(compute_logits(params, hidden, config=config), targets, sampler.TOP_LOGPROBS_MAX)
