"""The programs of speculative decoding with the MTP layer (SGLang's NEXTN): verify, commit and draft.

Each decode batch size B has a verify program (the target over ``1 + k`` tokens per row, ``k`` =
--speculative-num-steps: the last accepted token and the drafts) and a commit program (each row's GDN state
advanced over the tokens that were accepted); every step shape that produces hidden states (each extend bucket,
and each verify shape) has a draft program (the MTP layer over the step's positions, then run recursively for
``k - 1`` more positions). The scheduler's side is engine/scheduler/speculative.py; the math is model/mtp.py
(drafts) and model/forward.py (``TARGET_VERIFY``, ``commit_gdn_states``).

Keys: ``("verify", B)``, ``("commit", B)``, ``("draft", B, T, P)``. Programs take the step's packed host array
(programs.pack_step, token_src -1) so their scheduler-thread cost is that of a forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.engine.runner.buckets import BucketSet
from sglang_tpu_qwen.engine.runner.device_state import DeviceState, abstract
from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import commit_gdn_states, compute_logits, forward_step
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_qwen.model.mtp import mtp_forward
from sglang_tpu_qwen.parallel.sharded_forward import grouped_rows_pspec, make_sharded_forward, make_sharded_rows
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs

SPEC_KINDS = ("verify", "commit", "draft")


class SpecPrograms:
    """The jitted verify / commit / draft functions of one runner and their abstract lowering."""

    def __init__(self, config: Qwen35MoeConfig, param_leaves: list[Any], param_def: Any, state: DeviceState,
                 buckets: BucketSet, backends: KernelBackends, dtype: Any, steps: int,
                 columns: Callable[[int, int], int], unpack: Callable[..., ForwardBatch],
                 moe_combine: str = "hierarchical") -> None:
        """`steps`: draft tokens per row (k); `columns(T, P)` the packed step's width; `unpack(packed, P)` the
        packed step as a ForwardBatch (programs.unpack_step with no kept ids). On a mesh every program runs per
        DP rank on its rows (parallel/sharded_forward.py), the MTP layer's MoE over the expert axis."""
        self.config, self.buckets, self.dtype, self.steps = config, buckets, dtype, steps
        self.state, self.placement = state, state.placement
        self.param_leaves, self.columns = param_leaves, columns
        self.tokens = steps + 1
        pages = buckets.pages
        params = jax.tree.unflatten(param_def, param_leaves)
        period = len(params["layers"])
        gdn_positions = [j for j, kind in enumerate(config.layer_types[:period]) if kind != "full_attention"]
        # The commit program reads only the GDN layers' conv kernels (stacked [G, conv_dim, K]).
        self.conv_weights = [params["layers"][j]["gdn"]["conv1d"] for j in gdn_positions]
        draft_body = partial(_draft_tokens, backends=backends, steps=steps, page_size=state.sizing.page_size)
        commit_body = partial(_commit_rows, gdn_positions=tuple(gdn_positions), period=period)
        layout = self.placement.layout
        if layout is None:
            target = partial(forward_step, config=config, backends=backends)
            draft_fn = partial(draft_body, config=config)
            commit_fn = partial(commit_body, config=config)
        else:
            target = make_sharded_forward(layout, config, params, combine=moe_combine,
                                          forward=partial(forward_step, backends=backends),
                                          verify_gdn_layers=len(gdn_positions))
            rows, grouped, cspec = batch_pspec(layout), grouped_rows_pspec(layout), cache_pspecs(layout)
            draft_fn = make_sharded_rows(layout, config, params, draft_body, (rows,), (rows, cspec),
                                         combine=moe_combine)
            saved = tuple((grouped, grouped, grouped) for _ in gdn_positions)
            commit_fn = make_sharded_rows(layout, config, self.conv_weights, commit_body, (saved, rows, rows), cspec)

        def params_of(leaves: list[Any]) -> dict[str, Any]:
            return jax.tree.unflatten(param_def, leaves)

        def verify(leaves, cache, packed):
            batch = dataclasses.replace(unpack(packed, pages), mode=ForwardMode.TARGET_VERIFY)
            hidden, cache, saved = target(params_of(leaves), cache, batch)
            return hidden, hidden.reshape(-1, hidden.shape[-1]), cache, saved

        def commit(conv_weights, cache, packed, saved, start, lens):
            return commit_fn(conv_weights, cache, unpack(packed, pages), saved, start, lens)

        def draft(leaves, cache, packed, hidden):
            return draft_fn(params_of(leaves), cache, unpack(packed, pages), hidden)

        self._verify = jax.jit(verify, donate_argnums=(1,))
        self._commit = jax.jit(commit, donate_argnums=(1,))  # saved is read again by a second commit
        self._draft = jax.jit(draft, donate_argnums=(1,))

    def keys(self) -> list[tuple]:
        """The verify and commit program of every decode batch size, the draft program of every step shape."""
        t = self.tokens
        decode = [bk for bk in self.buckets.step_buckets() if bk.mode == "decode"]
        keys: list[tuple] = [("verify", bk.batch) for bk in decode] + [("commit", bk.batch) for bk in decode]
        shapes = {(bk.batch, bk.tokens, bk.pages) for bk in self.buckets.step_buckets() if bk.mode == "extend"}
        shapes |= {(bk.batch, t, bk.pages) for bk in decode} | {(bk.batch, 1, bk.pages) for bk in decode}
        return keys + [("draft", *shape) for shape in sorted(shapes)]

    def sample_batches(self) -> list[int]:
        """Sampling batch sizes of the verify steps: B * (k + 1) rows, one per position of each row."""
        return sorted({bk.batch * self.tokens for bk in self.buckets.step_buckets() if bk.mode == "decode"})

    def lower(self, key: tuple) -> jax.stages.Lowered:
        """The program `key` lowered from abstract arguments with their shardings; KeyError for another key."""
        spec, i32 = self.placement.spec, jnp.int32
        h, p = self.config.hidden_size, self.buckets.pages
        leaves, cache = abstract(self.param_leaves), abstract(self.state.cache)
        if key[0] == "verify":
            b = key[1]
            return self._verify.lower(leaves, cache, spec((b, self.columns(self.tokens, p)), i32))
        if key[0] == "commit":
            b = key[1]
            saved = jax.eval_shape(self._verify, leaves, cache, spec((b, self.columns(self.tokens, p)), i32))[3]
            return self._commit.lower(abstract(self.conv_weights), cache, spec((b, self.columns(self.tokens, p)), i32),
                                      saved, spec((b,), i32), spec((b,), i32))
        if key[0] == "draft":
            _, b, t, pages = key
            return self._draft.lower(leaves, cache, spec((b, self.columns(t, pages)), i32), spec((b, t, h), self.dtype))
        raise KeyError(key)


def _commit_rows(conv_weights: list[jax.Array], cache: dict[str, jax.Array], batch: ForwardBatch, saved: Any,
                 start: jax.Array, lens: jax.Array, *, config: Qwen35MoeConfig, gdn_positions: tuple[int, ...],
                 period: int, moe_fn: Any = None) -> dict[str, jax.Array]:
    """Row b's tokens [start_b, start_b + lens_b) of a verify step committed, its state already at start_b
    (model/forward.py commit_gdn_states over the saved inputs shifted by start)."""
    saved = jax.tree.map(partial(_shift_tokens, start=start), saved)
    batch = dataclasses.replace(batch, prefix_lens=batch.prefix_lens + start)
    layers: list[dict[str, Any]] = [{} for _ in range(period)]
    for j, w in zip(gdn_positions, conv_weights, strict=True):
        layers[j] = {"gdn": {"conv1d": w}}
    return commit_gdn_states({"layers": layers}, cache, batch, saved, lens, config=config)


def _shift_tokens(x: jax.Array, *, start: jax.Array) -> jax.Array:
    """``[G, B, T, ...]`` -> the same with row b's tokens shifted left by ``start[b]`` (the tail repeats the last
    token; commit lengths never reach it)."""
    t = x.shape[2]
    idx = jnp.minimum(jnp.arange(t, dtype=jnp.int32)[None, :] + start[:, None], t - 1)  # [B, T]
    idx = idx.reshape((1, *idx.shape) + (1,) * (x.ndim - 3))
    return jnp.take_along_axis(x, jnp.broadcast_to(idx, (x.shape[0], *idx.shape[1:3], *x.shape[3:])), axis=2)


def _draft_tokens(params: dict[str, Any], cache: dict[str, jax.Array], batch: ForwardBatch, hidden: jax.Array, *,
                  config: Qwen35MoeConfig, backends: KernelBackends, steps: int, page_size: int,
                  moe_fn: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MTP layer over a step's positions, then ``steps - 1`` recursive steps: ``(drafts [B, steps] int32,
    cache)``.

    Row b's ``input_ids[b, t]`` is the token after position ``prefix_lens[b] + t`` and ``hidden[b, t]`` the
    target's hidden state there, for ``t < extend_lens[b]`` (model/mtp.py). The first draft is the MTP layer's
    argmax at the row's last position; each further one feeds the previous draft and the MTP layer's own output
    at the next position (SGLang's EAGLE/NEXTN chain with top-k 1). A recursive position past the row's pages
    (or a row without positions) writes to the trash page and its draft is meaningless; the scheduler never uses
    drafts past what the row may still generate.
    """
    z, cache = mtp_forward(params, cache, batch, hidden, config=config, backends=backends, moe_fn=moe_fn)
    rows = jnp.arange(batch.batch_size)
    n = batch.extend_lens
    last = z[rows, jnp.maximum(n - 1, 0)]
    capacity = jnp.sum(batch.page_table > 0, axis=1, dtype=jnp.int32) * page_size
    tok = jnp.argmax(compute_logits(params, last, config=config), axis=-1).astype(jnp.int32)
    drafts = [tok]
    for i in range(1, steps):
        pos = batch.prefix_lens + n - 1 + i
        ok = (n > 0) & (pos < capacity)
        step = ForwardBatch(ForwardMode.DECODE, tok[:, None], jnp.where(ok, pos, 0), ok.astype(jnp.int32),
                            jnp.where(ok[:, None], batch.page_table, 0), jnp.where(ok, batch.slot_ids, 0))
        z, cache = mtp_forward(params, cache, step, last[:, None], config=config, backends=backends, moe_fn=moe_fn)
        last = z[:, 0]
        tok = jnp.argmax(compute_logits(params, last, config=config), axis=-1).astype(jnp.int32)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), cache
