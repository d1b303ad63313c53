"""ModelRunner: owns the weights and the device cache, and runs jitted steps on bucketed shapes.

The scheduler hands it host (numpy) arrays; it pads them to bucket shapes so the number of distinct
compilations stays small, logs each new compilation, and returns host arrays.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sglang_tpu_qwen.engine import memory_accounting, sampler
from sglang_tpu_qwen.engine.weight_loading import fp8_step, load_weights
from sglang_tpu_qwen.kernels.dispatch import resolve_backends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig, load_config
from sglang_tpu_qwen.model.forward import compute_logits, forward_step, init_cache
from sglang_tpu_qwen.parallel.mesh import make_layout
from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs, param_pspecs, shardings
from sglang_tpu_qwen.server_args import ServerArgs

logger = logging.getLogger(__name__)


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


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
    """Host arrays of per-row sampling settings for one step; B rows (padding rows included)."""

    temperature: np.ndarray  # [B] float32
    top_p: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32, <= 0 off
    min_p: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] uint32
    steps: np.ndarray  # [B] int32
    repetition: np.ndarray  # [B] float32
    frequency: np.ndarray  # [B] float32
    presence: np.ndarray  # [B] float32
    seen_ids: np.ndarray | None  # [B, L] int32, -1 padded; None when no row has a penalty
    output_ids: np.ndarray | None  # [B, Lo] int32, -1 padded
    banned_ids: np.ndarray  # [B, S] int32, -1 padded: ids masked out (EOS before min_new_tokens)
    want_logprobs: bool  # any row returns logprobs
    num_top_logprobs: int  # top alternatives wanted by any row (0: none)
    token_bitmask: np.ndarray | None = None  # [B, ceil(V/32)] int32 grammar mask (grammar/bitmask.py); None: no grammar


class ModelRunner:
    """Weights, KV pages and GDN slots on device, and the jitted forward / sampling steps."""

    def __init__(self, model_path: str, args: ServerArgs, devices: list | None = None) -> None:
        """`devices`: where weights and cache live (the mesh's devices with --dp-size/--ep-size > 1, else the
        first one); default all devices / the default device."""
        self.config: Qwen35MoeConfig = load_config(model_path)
        self.dtype = resolve_dtype(args.dtype)
        # Data-parallel attention + expert-parallel MoE (DESIGN.md section 4): one mesh; each DP rank owns
        # a contiguous block of num_pages pages and num_slots slots of the global cache.
        self.dp = args.dp_size
        self.layout = make_layout(args.dp_size, args.ep_size, args.tp_size, devices=devices) \
            if args.dp_size * args.ep_size > 1 else None
        # Without a mesh, an explicit device list pins the engine to its first device (committed arrays: every
        # jitted step then runs there).
        self._device = devices[0] if devices and self.layout is None else None
        # Each tensor goes from the files straight into its final sharding (engine/weight_loading.py).
        self.params = load_weights(model_path, self.config, self.dtype, args, self.layout, self._device)
        if self.layout is not None:
            logger.info("mesh %s: attention dp=%d over %s, experts ep=%d, MoE combine %s",
                        dict(self.layout.mesh.shape), self.dp, "+".join(self.layout.batch_axes), args.ep_size,
                        args.moe_combine)
        self.page_size = args.page_size
        # Slot ids within a rank: 0 trash, [1, R] running requests, (R, R + S] prefix-cache snapshots.
        self.max_running_per_rank = -(-args.max_running_requests // self.dp)
        self.num_running_slots = self.max_running_per_rank + 1
        if args.disable_radix_cache or not self.config.num_gdn_layers:
            self.num_snapshot_slots = 0
        else:
            default = 2 * self.max_running_per_rank
            self.num_snapshot_slots = default if args.max_gdn_snapshots is None else args.max_gdn_snapshots
        self.num_slots = self.num_running_slots + self.num_snapshot_slots
        # The KV pool gets what the weights and the GDN slots leave (engine/memory_accounting.py).
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
        if self.layout is not None:  # zeros created in place: no device holds the global cache
            self.cache = jax.jit(make_cache, out_shardings=shardings(cache_pspecs(self.layout), self.layout))()
        elif self._device is not None:
            self.cache = jax.jit(make_cache, out_shardings=jax.sharding.SingleDeviceSharding(self._device))()
        else:
            self.cache = make_cache()
        self.memory_usage = memory_accounting.memory_usage(self.params, self.cache,
                                                           (self.num_pages - 1) * self.page_size)
        logger.info("KV pool: %d pages x %d tokens; GDN slots: %d running + %d snapshots%s", self.num_pages - 1,
                    self.page_size, self.num_running_slots - 1, self.num_snapshot_slots,
                    f" (each of {self.dp} DP ranks)" if self.dp > 1 else "")
        self.backends = resolve_backends(args.attention_backend, args.gdn_backend)
        logger.info("kernels: attention %s, gdn %s%s", self.backends.attention, self.backends.gdn,
                    " (Pallas interpret mode)" if self.backends.interpret else "")
        step = fp8_step(partial(forward_step, backends=self.backends), self.dtype)  # FP8 leaves: weight_loading.py
        if self.layout is None:
            self._forward = jax.jit(partial(step, config=self.config), donate_argnums=(1,))
        else:
            self._forward = jax.jit(make_sharded_forward(self.layout, self.config, self.params,
                                                         combine=args.moe_combine, forward=step),
                                    donate_argnums=(1,))
        self._sample = jax.jit(
            self._per_rank(partial(_sample_step, config=self.config)),
            static_argnames=("all_greedy", "max_top_k", "num_top", "use_penalty", "use_top_p", "use_min_p",
                             "want_logprobs", "use_bans", "use_grammar"),
        )
        self._logprobs = jax.jit(partial(_gathered_logprobs, config=self.config), static_argnames=("num_top",))
        self._seen_shapes: set[tuple] = set()

    def _per_rank(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(params, hidden, *row_arrays, **static)` run by each DP rank on its own rows.

        Without a mesh, fn itself. With one, a `shard_map` over the batch axes: rows are independent
        (per-row seeds), so each device samples the rows it computed and no data crosses devices (a
        global-batch jit would let XLA insert collectives for nothing). None arrays pass through.
        """
        if self.layout is None:
            return fn
        layout = self.layout
        pspecs = param_pspecs(self.params, layout)
        rows = batch_pspec(layout)

        def run(params: Any, hidden: jax.Array, *arrays: Any, **static: Any) -> Any:
            specs = tuple(P() if a is None else rows for a in arrays)
            return jax.shard_map(partial(fn, **static), mesh=layout.mesh, in_specs=(pspecs, rows, *specs),
                                 out_specs=rows, check_vma=False)(params, hidden, *arrays)

        return run

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

    def _note_shape(self, kind: str, shape: tuple) -> None:
        key = (kind, *shape)
        if key not in self._seen_shapes:
            self._seen_shapes.add(key)
            logger.info("compiling %s for bucket %s (%d compiled shapes)", kind, shape, len(self._seen_shapes))

    def forward(
        self, tokens: np.ndarray, prefix_lens: np.ndarray, new_lens: np.ndarray, page_table: np.ndarray,
        slot_ids: np.ndarray,
    ) -> jax.Array:
        """Run one step on already-bucketed host arrays; returns hidden [B, T, H] on device.

        tokens [B, T] int32; prefix_lens, new_lens, slot_ids [B] int32; page_table [B, P] int32. Page and
        slot ids are global; with dp > 1, B is a multiple of dp and rows [r*B/dp, (r+1)*B/dp) must use
        rank r's ids only (AssertionError otherwise).
        """
        page_table = self._to_rank_local(page_table, self.num_pages)
        slot_ids = self._to_rank_local(slot_ids, self.num_slots)
        self._note_shape("forward", tokens.shape + page_table.shape[1:])
        hidden, self.cache = self._forward(
            self.params, self.cache, jnp.asarray(tokens), jnp.asarray(prefix_lens), jnp.asarray(new_lens),
            jnp.asarray(page_table), jnp.asarray(slot_ids))
        return hidden

    def sample(
        self, hidden: jax.Array, last_index: np.ndarray, batch: SamplingBatch
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sample one token per row from hidden[b, last_index[b]].

        Returns host arrays (tokens [B] int32, logprob [B] float32, top_logprobs [B, K], top_ids [B, K]).
        """
        all_greedy = bool(np.all(batch.temperature <= 0.0))
        active_k = batch.top_k[batch.top_k > 0]
        max_top_k = 0 if all_greedy or active_k.size == 0 else next_pow2(int(active_k.max()))
        max_top_k = min(max_top_k, self.config.vocab_size)
        use_penalty = batch.seen_ids is not None
        use_top_p = not all_greedy and bool(np.any(batch.top_p < 1.0))
        use_min_p = not all_greedy and bool(np.any(batch.min_p > 0.0))
        use_bans = bool(np.any(batch.banned_ids >= 0))
        num_top = next_pow2(batch.num_top_logprobs) if batch.num_top_logprobs else 0
        use_grammar = batch.token_bitmask is not None
        self._note_shape("sample", (hidden.shape[0], all_greedy, max_top_k, num_top, use_penalty, use_top_p,
                                    use_min_p, batch.want_logprobs, use_bans, use_grammar,
                                    None if batch.seen_ids is None else batch.seen_ids.shape[1]))
        out = self._sample(
            self.params, hidden, jnp.asarray(last_index), jnp.asarray(batch.temperature),
            jnp.asarray(batch.top_p), jnp.asarray(batch.top_k), jnp.asarray(batch.min_p),
            jnp.asarray(batch.seeds), jnp.asarray(batch.steps), jnp.asarray(batch.repetition),
            jnp.asarray(batch.frequency), jnp.asarray(batch.presence),
            None if batch.seen_ids is None else jnp.asarray(batch.seen_ids),
            None if batch.output_ids is None else jnp.asarray(batch.output_ids),
            jnp.asarray(batch.banned_ids),
            None if batch.token_bitmask is None else jnp.asarray(batch.token_bitmask),
            all_greedy=all_greedy, max_top_k=max_top_k, num_top=num_top, use_penalty=use_penalty,
            use_top_p=use_top_p, use_min_p=use_min_p, want_logprobs=batch.want_logprobs, use_bans=use_bans,
            use_grammar=use_grammar)
        return tuple(np.asarray(x) for x in jax.device_get(out))  # type: ignore[return-value]

    def logprobs_at(
        self, hidden: jax.Array, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray, num_top: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Logprob of targets[i] predicted at hidden[rows[i], cols[i]] (prompt logprobs).

        rows, cols, targets: [N] int32. Returns (logprob [N], top_logprobs [N, K], top_ids [N, K]).
        """
        n = len(rows)
        size = next_pow2(n, 16)
        pad = size - n
        rows_p, cols_p, tgt_p = (np.pad(a.astype(np.int32), (0, pad)) for a in (rows, cols, targets))
        k = next_pow2(num_top) if num_top else 0
        if self.layout is not None:
            # Rows of several ranks: gather them on the host (prompt logprobs only) rather than across devices.
            picked = np.asarray(jax.device_get(hidden))[rows_p, cols_p]
            hidden, rows_p, cols_p = picked[:, None, :], np.arange(size, dtype=np.int32), np.zeros(size, np.int32)
        self._note_shape("logprobs", (hidden.shape[0], hidden.shape[1], size, k))
        lp, top_lp, top_ids = jax.device_get(self._logprobs(
            self.params, hidden, jnp.asarray(rows_p), jnp.asarray(cols_p), jnp.asarray(tgt_p), num_top=k))
        return np.asarray(lp)[:n], np.asarray(top_lp)[:n, :num_top], np.asarray(top_ids)[:n, :num_top]


def _sample_step(
    params, hidden, last_index, temperature, top_p, top_k, min_p, seeds, steps, repetition, frequency,
    presence, seen_ids, output_ids, banned_ids, token_bitmask, *, config, all_greedy, max_top_k, num_top,
    use_penalty, use_top_p, use_min_p, want_logprobs, use_bans, use_grammar,
):
    """Logits at each row's last new token, then the grammar mask, penalties, bans and sampling (see
    sampler.sample); logprobs are those of the raw logits."""
    rows = jnp.arange(hidden.shape[0])
    logits = compute_logits(params, hidden[rows, last_index], config=config)
    raw = logits
    if use_grammar:
        logits, allowed = sampler.apply_token_bitmask(logits, token_bitmask)
    if use_penalty:
        logits = sampler.apply_penalties(logits, seen_ids, output_ids, repetition, frequency, presence)
    if use_bans:
        v = logits.shape[-1]
        banned = logits.at[rows[:, None], jnp.where(banned_ids >= 0, banned_ids, v)].set(
            sampler.NEG_INF, mode="drop")
        if use_grammar:  # where the grammar allows only banned ids (EOS before min_new_tokens), the grammar wins
            keeps_one = jnp.any(allowed & (banned > sampler.NEG_INF), axis=-1, keepdims=True)
            banned = jnp.where(keeps_one, banned, logits)
        logits = banned
    tokens = sampler.sample(logits, temperature, top_p, top_k, min_p, seeds, steps,
                            all_greedy=all_greedy, max_top_k=max_top_k, use_top_p=use_top_p,
                            use_min_p=use_min_p)
    if not want_logprobs:
        b = tokens.shape[0]
        return tokens, jnp.zeros(b, jnp.float32), jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    lp, top_lp, top_ids = sampler.token_logprobs(raw, tokens, num_top)
    return tokens, lp, top_lp, top_ids


def _gathered_logprobs(params, hidden, rows, cols, targets, *, config, num_top):
    logits = compute_logits(params, hidden[rows, cols], config=config)
    return sampler.token_logprobs(logits, targets, num_top)
