"""The programs of speculative decoding with the MTP layer (SGLang's NEXTN): verify, commit, draft.

Each decode batch size B has a verify program (the target over ``1 + k`` tokens per row, ``k`` =
--speculative-num-steps: the last accepted token and the drafts, read from the previous verify step's carry for
rows whose tokens the host does not know yet), a commit program and a steps program (the carried rows' sampling
steps). The commit program is the rest of the verify step in one dispatch: greedy sampling of every position
when the step is all greedy (``lax.cond``; else the sampling program's tokens come in), the accepted counts,
each row's GDN state advanced over them with the decode snapshot at a page boundary, the MTP layer's drafts
from the accepted positions and the carry the next verify step reads. Each extend bucket and each plain decode
bucket also has a draft program (the MTP layer over the step's positions, then run recursively for ``k - 1``
more positions). The scheduler's side is engine/scheduler/speculative.py; the math is model/mtp.py (drafts) and
model/forward.py (``TARGET_VERIFY``, ``commit_gdn_states``).

Keys: ``("verify", B)``, ``("commit", B)``, ``("spec_steps", B)``, ``("draft", B, T, P)``. Programs take the
step's packed host array (programs.pack_step) so their scheduler-thread cost is that of a forward. One program
for what follows the verify forward, not five: on the v5e a verify step of the trained tiny model was host-bound
(five dispatches, four reads: 3.11 ms against a plain step's 1.47 ms, docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.engine.runner.buckets import BucketSet
from sglang_tpu_qwen.engine.runner.device_state import DeviceState, abstract
from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.kernels.greedy_head.reference import greedy_lm_head_reference
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import commit_gdn_states, forward_step, lm_head_weight
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_qwen.model.mtp import mtp_forward
from sglang_tpu_qwen.parallel.sharded_forward import grouped_rows_pspec, make_sharded_forward, make_sharded_rows
from sglang_tpu_qwen.parallel.sharding import batch_pspec, cache_pspecs

SPEC_KINDS = ("verify", "commit", "draft", "spec_steps")


class SpecPrograms:
    """The jitted verify / commit / draft functions of one runner and their abstract lowering."""

    def __init__(self, config: Qwen35MoeConfig, param_leaves: list[Any], param_def: Any, state: DeviceState,
                 buckets: BucketSet, backends: KernelBackends, dtype: Any, steps: int,
                 columns: Callable[[int, int], int], unpack: Callable[..., ForwardBatch], prev_rows: int,
                 head_leaves: list[Any], greedy: Callable[[list[Any], jax.Array], jax.Array],
                 moe_combine: str = "hierarchical", draft_vocab: np.ndarray | None = None) -> None:
        """`steps`: draft tokens per row (k); `columns(T, P)` the packed step's width; `unpack(packed, P)` the
        packed step as a ForwardBatch (programs.unpack_step with no kept ids); `prev_rows`: the rows of the
        carry (the largest sampling batch, as overlap scheduling's kept ids); `greedy(head_leaves, last)`:
        the greedy sampling program's tokens [N] int32 of last [N, H] (programs.py, per DP rank); `draft_vocab`:
        the sorted [V'] int32 ids the drafts choose among (--speculative-token-map; None: all). On a mesh
        every program runs per DP rank on its rows (parallel/sharded_forward.py), the MTP layer's MoE over the
        expert axis."""
        self.config, self.buckets, self.dtype, self.steps = config, buckets, dtype, steps
        self.state, self.placement = state, state.placement
        self.head_leaves, self.columns = head_leaves, columns
        self.tokens = steps + 1
        pages = buckets.pages
        params = jax.tree.unflatten(param_def, param_leaves)
        period = len(params["layers"])
        gdn_positions = [j for j, kind in enumerate(config.layer_types[:period]) if kind != "full_attention"]
        # Each program takes only the parameters it reads: a compiled call costs host time per argument leaf (on
        # the v5e's host 0.3-0.5 ms a call of the trained tiny model's programs, which were host-bound). The
        # verify: the target model; the drafts: the MTP layer, the embeddings and the lm_head; the commit: those
        # and the GDN layers' conv kernels (stacked [G, conv_dim, K]).
        target_params = {k: v for k, v in params.items() if k != "mtp"}
        mtp_params = {k: params[k] for k in ("mtp", "embed", "lm_head") if k in params}
        conv_weights = [params["layers"][j]["gdn"]["conv1d"] for j in gdn_positions]
        self.target_leaves, target_def = jax.tree.flatten(target_params)
        self.draft_leaves, draft_def = jax.tree.flatten(mtp_params)
        self.commit_leaves, commit_def = jax.tree.flatten((mtp_params, conv_weights))
        draft_body = partial(_draft_tokens, backends=backends, steps=steps, page_size=state.sizing.page_size,
                             draft_vocab=draft_vocab)
        commit_body = partial(_commit_rows, gdn_positions=tuple(gdn_positions), period=period, backends=backends)
        layout = self.placement.layout
        if layout is None:
            target = partial(forward_step, config=config, backends=backends)
            draft_fn = partial(draft_body, config=config)
            commit_fn = partial(commit_body, config=config)
        else:
            target = make_sharded_forward(layout, config, target_params, combine=moe_combine,
                                          forward=partial(forward_step, backends=backends),
                                          verify_gdn_layers=len(gdn_positions))
            rows, grouped, cspec = batch_pspec(layout), grouped_rows_pspec(layout), cache_pspecs(layout)
            draft_fn = make_sharded_rows(layout, config, mtp_params, draft_body, (rows,), (rows, cspec),
                                         combine=moe_combine)
            saved = tuple((grouped, grouped, grouped) for _ in gdn_positions)
            commit_fn = make_sharded_rows(layout, config, conv_weights, commit_body, (saved, rows, rows), cspec)

        t, ps, prev_rows = self.tokens, state.sizing.page_size, prev_rows
        rows_sharding, replicated = self.placement.rows(2), self.placement.replicated()

        def verify(leaves, cache, packed, carry):
            batch = dataclasses.replace(unpack(packed, pages), mode=ForwardMode.TARGET_VERIFY)
            batch, shift = _from_carry(batch, packed[:, t + 3], carry, ps)
            hidden, cache, saved = target(jax.tree.unflatten(target_def, leaves), cache, batch)
            return (hidden, hidden.reshape(-1, hidden.shape[-1]), cache, saved, batch.input_ids, batch.extend_lens,
                    shift)

        def commit(leaves, head_leaves, cache, packed, saved, hidden, fed, fed_lens, snap, sampled, greedy_flag):
            draft_params, conv = jax.tree.unflatten(commit_def, leaves)
            last = hidden.reshape(-1, hidden.shape[-1])
            # An all-greedy step samples here (one dispatch less); otherwise the sampling program's tokens.
            tokens = jax.lax.cond(greedy_flag[0], lambda: greedy(head_leaves, last), lambda: sampled)
            batch = unpack(packed, pages)
            toks = tokens.reshape(fed.shape)
            got = accepted_lengths(toks, fed, jnp.where(batch.extend_lens > 0, fed_lens, 0))  # 0: a skipped row
            end = batch.prefix_lens + got
            written = (got > 0) & (end % ps == 0) & (snap[:, 0] > 0)  # the run ends on a page boundary
            cache = commit_fn(conv, cache, batch, saved, got, jnp.where(written, snap[:, 0], 0))
            # Whether the next verify step must stop at the next boundary: the snapshot lags the last one.
            behind = (end // ps * ps > jnp.where(written, end, snap[:, 1])).astype(jnp.int32)
            # The draft step: the tokens after each position are the sampled ones, `got` of them.
            drafting = jax.lax.with_sharding_constraint(packed.at[:, :t].set(toks).at[:, t + 1].set(got),
                                                        rows_sharding)
            drafts, cache = draft_fn(draft_params, cache, unpack(drafting, pages), hidden)
            carry = jax.lax.with_sharding_constraint(_next_carry(drafting, drafts, behind, t, prev_rows), replicated)
            accepted = jnp.concatenate([got[:, None], fed_lens[:, None], drafts, toks], axis=1).astype(jnp.int32)
            return cache, accepted, carry

        def draft(leaves, cache, packed, hidden):
            return draft_fn(jax.tree.unflatten(draft_def, leaves), cache, unpack(packed, pages), hidden)

        def shift_steps(steps, shift):
            return jax.lax.with_sharding_constraint(steps + jnp.repeat(shift, t), self.placement.rows(1))

        self._verify = jax.jit(verify, donate_argnums=(1,))
        self._commit = jax.jit(commit, donate_argnums=(2,))
        self._draft = jax.jit(draft, donate_argnums=(1,))
        self._shift_steps = jax.jit(shift_steps)
        self.carry_shape = (prev_rows, t + 3)

    def keys(self) -> list[tuple]:
        """The verify and commit program of every decode batch size, the draft program of every other step
        shape (extend buckets, plain decode steps)."""
        decode = [bk for bk in self.buckets.step_buckets() if bk.mode == "decode"]
        keys: list[tuple] = [(kind, bk.batch) for kind in ("verify", "commit", "spec_steps") for bk in decode]
        shapes = {(bk.batch, bk.tokens, bk.pages) for bk in self.buckets.step_buckets() if bk.mode == "extend"}
        shapes |= {(bk.batch, 1, bk.pages) for bk in decode}
        return keys + [("draft", *shape) for shape in sorted(shapes)]

    def sample_batches(self) -> list[int]:
        """Sampling batch sizes of the verify steps: B * (k + 1) rows, one per position of each row."""
        return sorted({bk.batch * self.tokens for bk in self.buckets.step_buckets() if bk.mode == "decode"})

    def lower(self, key: tuple) -> jax.stages.Lowered:
        """The program `key` lowered from abstract arguments with their shardings; KeyError for another key."""
        spec, i32 = self.placement.spec, jnp.int32
        h, p = self.config.hidden_size, self.buckets.pages
        cache = abstract(self.state.cache)
        t, carry = self.tokens, spec(self.carry_shape, i32, replicated=True)
        target = abstract(self.target_leaves)
        if key[0] == "verify":
            return self._verify.lower(target, cache, spec((key[1], self.columns(t, p)), i32), carry)
        if key[0] == "commit":
            b = key[1]
            packed = spec((b, self.columns(t, p)), i32)
            saved = jax.eval_shape(self._verify, target, cache, packed, carry)[3]
            return self._commit.lower(abstract(self.commit_leaves), abstract(self.head_leaves), cache, packed, saved,
                                      spec((b, t, h), self.dtype), spec((b, t), i32), spec((b,), i32),
                                      spec((b, 2), i32), spec((b * t,), i32),
                                      spec((1,), jnp.bool_, replicated=True))
        if key[0] == "draft":
            _, b, tokens, pages = key
            return self._draft.lower(abstract(self.draft_leaves), cache, spec((b, self.columns(tokens, pages)), i32),
                                     spec((b, tokens, h), self.dtype))
        if key[0] == "spec_steps":
            b = key[1]
            return self._shift_steps.lower(spec((b * t,), i32), spec((b,), i32))
        raise KeyError(key)


def split_accepted(accepted: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The commit program's ``accepted`` [B, 2 + k + T] int32 read on the host -> (accepted counts [B], tokens
    fed [B], drafts [B, k], sampled tokens [B * T], row b's position t at b * T + t)."""
    return (accepted[:, 0], accepted[:, 1], accepted[:, 2 : 2 + steps],
            np.ascontiguousarray(accepted[:, 2 + steps :]).reshape(-1))


def _commit_rows(conv_weights: list[jax.Array], cache: dict[str, jax.Array], batch: ForwardBatch, saved: Any,
                 lens: jax.Array, snap_ids: jax.Array, *, config: Qwen35MoeConfig,
                 gdn_positions: tuple[int, ...], period: int, backends: KernelBackends | None = None,
                 moe_fn: Any = None) -> dict[str, jax.Array]:
    """model/forward.py ``commit_gdn_states`` with the GDN layers' conv kernels as its only parameters (through
    the fused GDN kernel when ``backends.gdn`` is Pallas)."""
    layers: list[dict[str, Any]] = [{} for _ in range(period)]
    for j, w in zip(gdn_positions, conv_weights, strict=True):
        layers[j] = {"gdn": {"conv1d": w}}
    return commit_gdn_states({"layers": layers}, cache, batch, saved, lens, snap_ids, config=config,
                             backends=backends)


def accepted_lengths(sampled: jax.Array, fed: jax.Array, fed_lens: jax.Array) -> jax.Array:
    """Tokens each verify row accepts: ``sampled [B, T]`` (the target's token at each position), ``fed [B, T]``
    (the last token, then the drafts), ``fed_lens [B]`` -> ``[B]`` int32, 1 + the drafts equal to the target's
    token before them (0 for a row that fed nothing). The host applies the same rule, stops included
    (engine/scheduler/speculative.py)."""
    t = fed.shape[1]
    match = (sampled[:, :-1] == fed[:, 1:]) & (jnp.arange(t - 1)[None, :] < fed_lens[:, None] - 1)
    run = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return jnp.where(fed_lens > 0, 1 + run, 0).astype(jnp.int32)


def _from_carry(batch: ForwardBatch, src: jax.Array, carry: jax.Array,
                page_size: int) -> tuple[ForwardBatch, jax.Array]:
    """Overlap scheduling: a verify row whose previous verify step is still in flight (``src[b] >= 0``, its row
    there) takes its fed tokens and its start from the carry (``_next_carry``), which the host does not know yet;
    where the carry says its decode snapshot lags, it feeds no token past its next page boundary (the host caps
    its own rows alike: engine/scheduler/speculative.py). Returns the batch and each row's shift [B] int32 (the
    tokens that step accepted: its sampling steps move by as many)."""
    t = batch.num_tokens
    use = src >= 0
    row = carry[jnp.clip(src, 0, carry.shape[0] - 1)]
    ids = jnp.where(use[:, None], row[:, :t], batch.input_ids)
    prefix = jnp.where(use, row[:, t], batch.prefix_lens)
    cap = jnp.where(use & (row[:, t + 2] > 0), page_size - prefix % page_size, t)
    batch = dataclasses.replace(batch, input_ids=ids, prefix_lens=prefix,
                                extend_lens=jnp.minimum(batch.extend_lens, cap))
    return batch, jnp.where(use, row[:, t + 1], 0)


def _next_carry(drafting: jax.Array, drafts: jax.Array, behind: jax.Array, t: int, rows: int) -> jax.Array:
    """The carry [rows, T + 3] int32 a verify step leaves for the next one: row b's next fed tokens (its last
    accepted token, then its new drafts), its next start (prefix + accepted), its accepted count and whether its
    decode snapshot lags (``behind`` [B]); from the draft program's packed step (``drafting``: the sampled
    tokens, prefix, accepted count) and ``drafts [B, k]``."""
    b = drafting.shape[0]
    got = drafting[:, t + 1]
    last = drafting[jnp.arange(b), jnp.maximum(got - 1, 0)]
    row = jnp.concatenate([last[:, None], drafts, (drafting[:, t] + got)[:, None], got[:, None], behind[:, None]],
                          axis=1)
    return jnp.zeros((rows, t + 3), jnp.int32).at[:b].set(row.astype(jnp.int32))


def _draft_tokens(params: dict[str, Any], cache: dict[str, jax.Array], batch: ForwardBatch, hidden: jax.Array, *,
                  config: Qwen35MoeConfig, backends: KernelBackends, steps: int, page_size: int,
                  draft_vocab: np.ndarray | None = None,
                  moe_fn: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MTP layer over a step's positions, then ``steps - 1`` recursive steps: ``(drafts [B, steps] int32,
    cache)``.

    Row b's ``input_ids[b, t]`` is the token after position ``prefix_lens[b] + t`` and ``hidden[b, t]`` the
    target's hidden state there, for ``t < extend_lens[b]`` (model/mtp.py). The first draft is the MTP layer's
    argmax at the row's last position; each further one feeds the previous draft and the MTP layer's own output
    at the next position (SGLang's EAGLE/NEXTN chain with top-k 1). A recursive position past the row's pages
    (or a row without positions) writes to the trash page and its draft is meaningless; the scheduler never uses
    drafts past what the row may still generate. ``draft_vocab``: the ids a draft may take (``_draft_argmax``).
    """
    z, cache = mtp_forward(params, cache, batch, hidden, config=config, backends=backends, moe_fn=moe_fn)
    rows = jnp.arange(batch.batch_size)
    n = batch.extend_lens
    last = z[rows, jnp.maximum(n - 1, 0)]
    capacity = jnp.sum(batch.page_table > 0, axis=1, dtype=jnp.int32) * page_size
    tok = _draft_argmax(params, last, config, draft_vocab, backends)
    drafts = [tok]
    for i in range(1, steps):
        pos = batch.prefix_lens + n - 1 + i
        ok = (n > 0) & (pos < capacity)
        step = ForwardBatch(ForwardMode.DECODE, tok[:, None], jnp.where(ok, pos, 0), ok.astype(jnp.int32),
                            jnp.where(ok[:, None], batch.page_table, 0), jnp.where(ok, batch.slot_ids, 0))
        z, cache = mtp_forward(params, cache, step, last[:, None], config=config, backends=backends, moe_fn=moe_fn)
        last = z[:, 0]
        tok = _draft_argmax(params, last, config, draft_vocab, backends)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), cache


def _draft_argmax(params: dict[str, Any], last: jax.Array, config: Qwen35MoeConfig,
                  draft_vocab: np.ndarray | None, backends: KernelBackends) -> jax.Array:
    """The draft token ``[B]`` int32 of the MTP layer's output ``last [B, H]``: the argmax of its logits over the
    vocabulary (``backends.sampling.greedy_ids``: kernels/greedy_head under --sampling-backend pallas), or over
    ``draft_vocab`` only (--speculative-token-map, SGLang's FR-Spec: the product reads those rows of the lm_head,
    gathered in the program; the ids are a constant of it)."""
    if draft_vocab is None:
        return backends.sampling.greedy_ids(last, lm_head_weight(params, config))
    ids = jnp.asarray(draft_vocab, jnp.int32)
    with jax.named_scope("lm_head"):
        rows = jnp.take(lm_head_weight(params, config), ids, axis=0)
        return ids[greedy_lm_head_reference(last, rows)]
