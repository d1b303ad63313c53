"""The grouped-matmul benchmark on the CPU: its cases build, its cost model counts only the experts a routing
touches, megablox's ``gmm`` (interpret mode) computes the model's FFN, and ``--small`` runs to the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.bench import grouped_matmul as gm

TINY = gm.Shape("tiny", 128, 128, 8, 2)


def test_cases_build_with_valid_routings():
    shapes = set()
    for case in gm.cases(small=False):
        gs = gm.routing(case)
        assert gs.shape == (case.shape.experts,) and gs.dtype == np.int32
        assert gs.sum() == case.assignments
        assert gs.max() <= case.tokens  # top_k distinct experts per token
        imps = gm.impls(case, on_tpu=True)
        assert imps[0].name == gm.REFERENCE and imps[0].form == "split"
        assert len({i.name for i in imps}) == len(imps)
        assert any(i.name.endswith("default") for i in imps)
        shapes.add(case.shape)
    assert {gm.QWEN35_35B, gm.QWEN35_35B_256, gm.QWEN35_397B} <= shapes
    # Decode at 8 rows leaves most experts empty: the case the grouped matmul must skip.
    assert np.count_nonzero(gm.routing(gm.Case(gm.QWEN35_397B, "decode", 8))) < 100
    # Off TPU every Pallas row is reported as skipped, none dropped.
    off = gm.impls(gm.Case(gm.SMALL, "decode", 8), on_tpu=False)
    assert [i.name for i in off if i.fn is not None] == [gm.REFERENCE, "ragged_dot"]
    assert all(i.skip for i in off if i.fn is None) and any(i.name.startswith("megablox") for i in off)


def test_cost_counts_only_touched_experts():
    case = gm.Case(gm.QWEN35_35B, "decode", 8)  # 64 assignments
    one = np.zeros(case.shape.experts, np.int32)
    one[5] = case.assignments
    c = gm.cost(case, one)
    per_expert = 3 * 2048 * 512 * 2
    assert c.touched == 1 and c.weight_bytes == per_expert
    assert c.act_bytes == 2 * 64 * 2048 * 2
    assert c.flops == 2 * 64 * (2048 * 2 * 512 + 512 * 2048)
    gs = gm.routing(case)
    c = gm.cost(case, gs)
    assert c.touched == np.count_nonzero(gs) < case.shape.experts
    assert c.weight_bytes == c.touched * per_expert
    assert c.flops == 2 * 64 * 3 * 2048 * 512  # flops depend on the rows, not on the experts touched


def test_weight_forms_match_their_specs():
    """The programs are compiled from weight_specs before the weights exist: each form's arrays match them;
    the split stacks are the two halves of the fused one (the same reference serves both)."""
    for form in ("split", "fp8", "fused"):
        args = gm.weight_args(form, gm.weights(TINY, form))
        assert [(a.shape, a.dtype) for a in args] == [(s.shape, s.dtype) for s in gm.weight_specs(TINY, form)]
    w_split, w_fused = gm.weights(TINY, "split"), gm.weights(TINY, "fused")
    np.testing.assert_array_equal(np.asarray(w_split["gate"]), np.asarray(w_fused["gate_up"][..., :128]))
    np.testing.assert_array_equal(np.asarray(w_split["up"]), np.asarray(w_fused["gate_up"][..., 128:]))
    np.testing.assert_array_equal(np.asarray(w_split["down"]), np.asarray(w_fused["down"]))


def test_megablox_interpret_matches_ragged_dot():
    """megablox gmm (Pallas interpret mode) equals the model's ragged_dot FFN on the valid rows, with empty
    groups, a group crossing a row tile, and padded rows past the groups (not visited)."""
    case = gm.Case(TINY, "decode", 16)  # 32 assignments
    gs = jnp.asarray([5, 0, 11, 0, 0, 9, 7, 0], jnp.int32)
    w_split, w_fused = gm.weights(TINY, "split"), gm.weights(TINY, "fused")
    ref = jax.jit(gm.ffn_model_form)(gm.activations(case, 32), *gm.weight_args("split", w_split), gs)
    mb = gm.ffn_fused(gm.megablox_matmul((16, 128, 128), interpret=True))
    out = jax.jit(mb)(gm.activations(case, 64), *gm.weight_args("fused", w_fused), gs)
    assert out.shape == (64, 128)
    err, ref_max = (float(v) for v in gm.max_errors(out, ref, m=32))
    assert ref_max > 0.1 and err <= gm.TOLERANCE * ref_max, (err, ref_max)
    fused = jax.jit(gm.ffn_fused(gm.ragged_dot_matmul))(gm.activations(case, 32), *gm.weight_args("fused", w_fused), gs)
    assert float(gm.max_errors(fused, ref, m=32)[0]) <= gm.TOLERANCE * ref_max


def test_small_run_on_cpu(capsys):
    gm.main(["--small", "--iters", "1"])
    out = capsys.readouterr().out
    assert "reference" in out and "MISMATCH" not in out and "failed to" not in out
    assert out.count(": ok") == 3  # ragged_dot (fused) against the model form, per case
    # The small prefill case (256 tokens) is a serving step's size: the step tilings too.
    prefill_tilings = 1 + len(gm.PREFILL_TILINGS) + len(gm.STEP_TILINGS)
    assert f"megablox ({prefill_tilings} tilings)" in out and "skipped: not a TPU" in out
    assert out.count(f"{gm.FP8_IMPL:<36}skipped: not a TPU") == 2  # the decode cases
    assert out.count(f"{'grouped_ffn tm 128 (project)':<36}skipped: not a TPU") == 3  # every case
    assert "compiles inside timed windows: 0;" in out
