"""bench.lm_head on the CPU (its Pallas kernel in interpret mode): the kernel's ids are jnp.argmax's, ties
included, and the small sweep times every implementation with every id right."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.bench import lm_head


def test_kernel_ids_are_argmax_with_lowest_id_on_ties():
    h, v, tv = 128, 512, 128
    key = jax.random.key(1)
    weight = jax.random.normal(key, (v, h), jnp.float32).astype(jnp.bfloat16)
    hidden = jax.random.normal(jax.random.fold_in(key, 1), (8, h), jnp.float32).astype(jnp.bfloat16)
    # Row 0's best vocabulary row copied to ids 300 (block 2) and 7 (block 0): equal logits; the lowest id wins.
    best = int(jnp.argmax(lm_head.logits_vh(hidden, weight)[0]))
    weight = weight.at[300].set(weight[best]).at[7].set(weight[best])
    ids = lm_head.greedy_lm_head(hidden, weight, tv=tv, interpret=True)
    expected = jnp.argmax(lm_head.logits_vh(hidden, weight), axis=-1)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(expected))
    assert int(ids[0]) == min(best, 7)


def test_id_check_counts_wrong_and_out_of_range_ids():
    logits = jnp.asarray([[0.0, 1.0, 0.5], [2.0, 2.0, -1.0]], jnp.float32)
    ref = jnp.argmax(logits, axis=-1)
    assert lm_head.check_ids(ref, logits, ref) == {"bad_rows": 0, "ids_differ": 0}
    assert lm_head.check_ids(jnp.asarray([1, 1]), logits, ref) == {"bad_rows": 0, "ids_differ": 1}  # a tie
    assert lm_head.check_ids(jnp.asarray([2, 3]), logits, ref) == {"bad_rows": 2, "ids_differ": 2}


def test_kernel_rejects_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="multiple"):
        lm_head.greedy_lm_head(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((300, 128), jnp.bfloat16), tv=128,
                               interpret=True)


def test_small_sweep_times_every_implementation(capsys):
    results = lm_head.main(["--iters", "1"])
    names = {imp.name for imp in lm_head.impls(lm_head.SMALL["blocks"], interpret=True)}
    assert {r["impl"] for r in results} == names
    assert all("us" in r for r in results), [r for r in results if "skipped" in r]
    checked = [r for r in results if "bad_rows" in r]
    assert len(checked) == len(lm_head.SMALL["rows"]) * (len(names) - 2)  # the two logits-only rows are unchecked
    assert all(r["bad_rows"] == 0 for r in checked)
    assert "compiles inside timed windows: 0" in capsys.readouterr().out
