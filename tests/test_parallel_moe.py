"""Sharded MoE and sharded forward (DP attention + expert parallelism) == the single-device model.

The checks need 8 devices, and the rest of the suite runs in this process with 1, so they run in a child
process (this file run as a script) with ``--xla_force_host_platform_device_count=8``; it prints one JSON
line per case with the largest error, and the tests here assert on those numbers.

Tolerance: float32 everywhere; the sharded path sums the k expert outputs and the device partial sums in
a different order than the single-device path and packs routing weights with 23 - 4 mantissa bits
(expert ids take 4 bits for 16 experts), so results agree to ~1e-5 relative, not bit for bit. We allow
2e-4 of the reference's largest magnitude.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pd_harness import compile_cache_env

TOL = 2e-4
LAYOUTS = [(1, 8), (2, 4), (8, 8)]  # (dp, ep); (8, 8) is the Ironwood host: attention dp8 + MoE ep8


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # XLA:CPU runs collectives on the shared intra-op pool (2 threads here); with the concurrency-optimised
    # scheduler and XNNPACK fusions, a device blocked in a rendezvous can starve the others (timeout).
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PJRT_NPROC"] = "16"  # >= 2 threads per device, else blocked collectives starve (launch_server.py)
    env.update(compile_cache_env())  # its programs compile once per machine, as the servers' do
    return env


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, float]]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=_child_env(), capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["case"]] = r
            print(f"{r['case']}: max abs err {r['max_abs_err']:.2e}, relative {r['rel_err']:.2e}")
    return out


def test_fp8_expert_parallel_moe_matches_single_device(results):
    """FP8 experts (Pallas grouped matmul, interpret mode) under dp8-ep8 equal the single-device block."""
    assert results["moe dp8 ep8 hierarchical fp8"]["rel_err"] < TOL


def test_local_experts_runs_skewed_routing_in_several_chunks():
    """A device's pairs beyond one chunk (every token routed to its experts) run as more chunks of the
    loop and still give the routed sum of its experts; other devices' experts contribute nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sglang_tpu_qwen.model.moe import routed_experts
    from sglang_tpu_qwen.parallel.expert_parallel import chunk_rows, local_experts

    m, k, e, e_local, h, i = 24, 2, 8, 4, 16, 8
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (m, h), jnp.float32)
    w_gate, w_up = (jax.random.normal(kk, (e, h, i), jnp.float32) / 4 for kk in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, i, h), jnp.float32) / 4
    weights = jax.random.uniform(keys[4], (m, k), jnp.float32)
    ids = jnp.stack([jnp.arange(m) % 4 + 4, (jnp.arange(m) + 1) % 4 + 4], axis=1).astype(jnp.int32)  # all on 4..7
    rows = chunk_rows(m * k, e_local, e)
    assert -(-m * k // rows) > 1  # the device holding experts 4..7 needs several chunks
    here = local_experts(x, weights, ids, w_gate[4:], w_up[4:], w_down[4:], jnp.int32(4), e)
    want = routed_experts(x, weights, ids, w_gate, w_up, w_down)
    assert here.shape == (m, h)  # dense experts: plain rows (MoeBackend.kernel_rows)
    np.testing.assert_allclose(np.asarray(here), np.asarray(want), rtol=1e-5, atol=1e-5)
    elsewhere = local_experts(x, weights, ids, w_gate[:4], w_up[:4], w_down[:4], jnp.int32(0), e)
    assert not np.any(np.asarray(elsewhere))


def test_local_experts_fp8_kernels_in_several_chunks():
    """The same with FP8 experts through the Pallas kernels (interpret mode, uninitialised memory read as
    NaN): the first chunk writes a new accumulator (each token's first pair overwrites its row, rows of
    tokens with no local pair are zeroed by the kernel), the later chunks add into it; a device none of whose
    experts is picked returns zeros, not uninitialised rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
    from sglang_tpu_qwen.model.moe import routed_experts
    from sglang_tpu_qwen.parallel.expert_parallel import chunk_rows, local_experts
    from sglang_tpu_qwen.quant import fp8

    m, k, e, e_local, h, i = 24, 2, 8, 4, 128, 128
    pallas = MoeBackend("pallas", interpret=True)
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (m, h), jnp.float32)
    stacks = [fp8.quantize(jax.random.normal(kk, shape, jnp.float32) / 8)
              for kk, shape in zip(keys[1:4], [(e, h, i), (e, h, i), (e, i, h)], strict=True)]
    weights = jax.random.uniform(keys[4], (m, k), jnp.float32)
    # Tokens 0..19 on experts 4..7 (several chunks there); 20..23 on experts 4 and 0 (one local pair each).
    ids = jnp.stack([jnp.arange(m) % 4 + 4, jnp.where(jnp.arange(m) < 20, (jnp.arange(m) + 1) % 4 + 4, 0)], axis=1)
    assert -(-int(jnp.sum(ids >= 4)) // chunk_rows(m * k, e_local, e)) > 1

    def experts(lo: int) -> list[fp8.Fp8Weight]:
        return [fp8.Fp8Weight(q=w.q[lo : lo + e_local], scale=w.scale[lo : lo + e_local], block=w.block)
                for w in stacks]

    rows = x.reshape(m, *pallas.kernel_rows(stacks[0], h))  # the kernels' row layout: [m, h / 128, 128]
    here = local_experts(rows, weights, ids.astype(jnp.int32), *experts(4), jnp.int32(4), e, backend=pallas)
    empty_ids = jnp.full((m, k), 4, jnp.int32).at[:, 1].set(5)
    nothing = local_experts(rows, weights, empty_ids, *experts(0), jnp.int32(0), e, backend=pallas)
    local_w = jnp.where(ids >= 4, weights, 0.0)
    want = routed_experts(x, local_w, ids.astype(jnp.int32), *(fp8.dequantize(w, jnp.float32) for w in stacks))
    assert here.shape == (m, h // 128, 128)
    np.testing.assert_allclose(np.asarray(here).reshape(m, h), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.array_equal(np.asarray(nothing), np.zeros((m, h // 128, 128), np.float32))


@pytest.mark.parametrize("dp,ep", LAYOUTS)
@pytest.mark.parametrize("combine", ["flat", "hierarchical"])
def test_sharded_moe_matches_single_device(results, dp, ep, combine):
    for routing in ("random", "one_expert", "top1_one_expert"):
        r = results[f"moe dp{dp} ep{ep} {combine} {routing}"]
        assert r["rel_err"] < TOL, r


def test_sharded_moe_micro_batches(results):
    r = results["moe dp8 ep8 hierarchical random mb3"]
    assert r["rel_err"] < TOL, r


@pytest.mark.parametrize("dp,ep,combine", [(1, 8, "hierarchical"), (2, 4, "flat"), (8, 8, "hierarchical"),
                                           (8, 8, "flat")])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_sharded_forward_matches_single_device(results, dp, ep, combine, phase):
    r = results[f"forward dp{dp} ep{ep} {combine} {phase}"]
    assert r["rel_err"] < TOL, r
    assert r["valid_tokens"] > 0


def test_hierarchical_reduce_scatter_equals_psum_scatter(results):
    """The two-stage combine on operands in its block order gives each device the flat one's block."""
    for n in (4, 8):
        r = results[f"reduce_scatter {n}"]
        assert r["max_abs_err"] < 1e-5, r


# ---------------------------------------------------------------- child process (8 emulated devices)


def _child() -> None:  # noqa: C901 - one linear script
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict, init_embedded_params
    from sglang_tpu_qwen.model.config import Qwen35MoeConfig
    from sglang_tpu_qwen.model.forward import forward_step, init_cache
    from sglang_tpu_qwen.model.forward_batch import ForwardBatch
    from sglang_tpu_qwen.model.moe import moe_block
    from sglang_tpu_qwen.parallel import collectives, sharding
    from sglang_tpu_qwen.parallel.expert_parallel import make_ep_moe_fn
    from sglang_tpu_qwen.parallel.mesh import EXPERT, make_layout
    from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward

    jax.config.update("jax_default_matmul_precision", "highest")
    assert len(jax.devices()) == 8
    d = embedded_config_dict()
    d["text_config"].update(vocab_size=512, num_experts=16, num_experts_per_tok=4)
    config = Qwen35MoeConfig.from_hf_dict(d)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_embedded_params(config))

    def emit(case: str, got: np.ndarray, want: np.ndarray, **extra: object) -> None:
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 1.0
        print(json.dumps({"case": case, "max_abs_err": err, "rel_err": err / max(scale, 1e-30), **extra}),
              flush=True)

    # Hierarchical reduce-scatter (operand blocks in its order) vs psum_scatter on the expert axis of a
    # dp2-ep4 and a dp1-ep8 mesh; each device's operand differs.
    for dp, ep in ((2, 4), (1, 8)):
        lay = make_layout(dp, ep)
        y = jax.random.normal(jax.random.key(1), (dp, ep, ep * 12, 5))
        order = collectives.block_order("hierarchical", ep)
        assert sorted(order) == list(range(ep)) and list(order) != list(range(ep))
        # Device d's rows (block d of the flat operand) moved to block order[d].
        y_hier = jnp.zeros_like(y).reshape(dp, ep, ep, 12, 5).at[:, :, order].set(y.reshape(dp, ep, ep, 12, 5))

        def rs(v, combine, lay=lay, ep=ep):
            return jax.jit(jax.shard_map(
                lambda a: collectives.reduce_scatter(a.reshape(-1, 5), EXPERT, ep, combine), mesh=lay.mesh,
                in_specs=P("data", EXPERT), out_specs=P(("data", EXPERT)), check_vma=False))(v)

        flat, hier = rs(y, "flat"), rs(y_hier.reshape(y.shape), "hierarchical")
        want = y.sum(axis=1).reshape(dp * ep * 12, 5)
        assert np.abs(np.asarray(flat) - np.asarray(want)).max() < 1e-5
        emit(f"reduce_scatter {ep}", np.asarray(hier), np.asarray(flat))

    # MoE block alone.
    moe_p = jax.tree.map(lambda a: a[0], params["layers"][0]["moe"])  # layer 0 (group 0 of stack 0)
    x = jax.random.normal(jax.random.key(2), (40, config.hidden_size), jnp.float32)
    one = dict(moe_p, router=jnp.zeros_like(moe_p["router"]).at[0, 11].set(10.0))
    x_one = x.at[:, 0].set(1.0)  # logit 10 for expert 11, 0 for the rest: every token's top-1 is expert 11
    top1 = dataclasses.replace(config, num_experts_per_tok=1)
    cases = [("random", moe_p, x, config), ("one_expert", one, x_one, config), ("top1_one_expert", one, x_one, top1)]
    for dp, ep in LAYOUTS:
        lay = make_layout(dp, ep)
        for combine in ("flat", "hierarchical"):
            for mb in (1, 3) if (dp, ep, combine) == (8, 8, "hierarchical") else (1,):
                fn = make_ep_moe_fn(EXPERT, ep, tokens_replicated=not lay.attention_spans_experts,
                                    combine=combine, micro_batches=mb)
                for name, p, xx, cfg in cases if mb == 1 else cases[:1]:
                    run = jax.jit(jax.shard_map(
                        functools.partial(fn, config=cfg), mesh=lay.mesh,
                        in_specs=(sharding.param_pspecs(p, lay), sharding.batch_pspec(lay)),
                        out_specs=sharding.batch_pspec(lay), check_vma=False))
                    got = run(sharding.shard_params(p, lay), xx)
                    want = moe_block(p, xx, cfg)
                    emit(f"moe dp{dp} ep{ep} {combine} {name}" + (f" mb{mb}" if mb > 1 else ""),
                         np.asarray(got), np.asarray(want))

    # FP8 experts and shared expert through the Pallas grouped matmul (the pallas MoE backend, interpret mode)
    # inside the expert-parallel shard_map, against the single-device block on the same FP8 weights (the
    # reference backend: XLA).
    from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
    from sglang_tpu_qwen.quant import fp8

    q = fp8.quantize_params(moe_p)
    lay = make_layout(8, 8)
    fn = make_ep_moe_fn(EXPERT, 8, tokens_replicated=False, combine="hierarchical")
    run = jax.jit(jax.shard_map(
        functools.partial(fn, config=config, backend=MoeBackend("pallas", interpret=True)), mesh=lay.mesh,
        in_specs=(sharding.param_pspecs(q, lay), sharding.batch_pspec(lay)),
        out_specs=sharding.batch_pspec(lay), check_vma=False))
    got = run(sharding.shard_params(q, lay), x)
    emit("moe dp8 ep8 hierarchical fp8", np.asarray(got), np.asarray(moe_block(q, x, config)))

    # Full forward: prefill (T=8, uneven lengths, one all-padding row) then one decode step.
    b, t, ps, pages, slots = 8, 8, 4, 64, 16
    new_prefill = np.array([5, 3, 0, 7, 1, 8, 2, 4], np.int32)
    rng = np.random.default_rng(0)
    tok_prefill = rng.integers(1, config.vocab_size, (b, t)).astype(np.int32)
    tok_decode = rng.integers(1, config.vocab_size, (b, 1)).astype(np.int32)
    ref_fwd = jax.jit(functools.partial(forward_step, config=config))
    for dp, ep, combine in [(1, 8, "hierarchical"), (2, 4, "flat"), (8, 8, "hierarchical"), (8, 8, "flat")]:
        lay = make_layout(dp, ep)
        rows, ppr, spr = b // dp, pages // dp, slots // dp
        local_pt = np.zeros((b, 4), np.int32)
        local_slot = np.zeros(b, np.int32)
        for row in range(b):
            i = row % rows  # row index within its rank
            local_pt[row, :3] = 1 + 3 * i + np.arange(3)
            local_slot[row] = 1 + i
        rank = np.arange(b) // rows
        global_pt = np.where(local_pt > 0, local_pt + (rank * ppr)[:, None], 0).astype(np.int32)
        global_slot = (local_slot + rank * spr).astype(np.int32)

        fwd = jax.jit(make_sharded_forward(lay, config, params, combine=combine))
        sp = sharding.shard_params(params, lay)
        cache = sharding.shard_cache(init_cache(config, pages, ps, slots, jnp.float32), lay)
        ref_cache = init_cache(config, pages, ps, slots, jnp.float32)
        steps = [("prefill", tok_prefill, np.zeros(b, np.int32), new_prefill),
                 ("decode", tok_decode, new_prefill, np.ones(b, np.int32))]
        for phase, tok, pre, new in steps:
            h, cache = fwd(sp, cache, ForwardBatch.of(tok, pre, new, local_pt, local_slot))
            h_ref, ref_cache = ref_fwd(params, ref_cache, ForwardBatch.of(tok, pre, new, global_pt, global_slot))
            valid = np.arange(tok.shape[1])[None, :] < new[:, None]
            emit(f"forward dp{dp} ep{ep} {combine} {phase}", np.asarray(h)[valid], np.asarray(h_ref)[valid],
                 valid_tokens=int(valid.sum()))


if __name__ == "__main__":
    _child()
