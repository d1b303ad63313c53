"""bench.lm_head on the CPU (the Pallas kernel in interpret mode): the id check counts wrong ids, and the small
sweep times every implementation with every id right (the kernel's own tests: tests/test_greedy_head.py)."""

import jax.numpy as jnp

from sglang_tpu_qwen.bench import lm_head


def test_id_check_counts_wrong_and_out_of_range_ids():
    logits = jnp.asarray([[0.0, 1.0, 0.5], [2.0, 2.0, -1.0]], jnp.float32)
    ref = jnp.argmax(logits, axis=-1)
    assert lm_head.check_ids(ref, logits, ref) == {"bad_rows": 0, "ids_differ": 0}
    assert lm_head.check_ids(jnp.asarray([1, 1]), logits, ref) == {"bad_rows": 0, "ids_differ": 1}  # a tie
    assert lm_head.check_ids(jnp.asarray([2, 3]), logits, ref) == {"bad_rows": 2, "ids_differ": 2}


def test_small_sweep_times_every_implementation(capsys):
    results = lm_head.main(["--iters", "1"])
    names = {imp.name for imp in lm_head.impls(lm_head.SMALL["blocks"], interpret=True)}
    assert {r["impl"] for r in results} == names
    assert all("us" in r for r in results), [r for r in results if "skipped" in r]
    checked = [r for r in results if "bad_rows" in r]
    assert len(checked) == len(lm_head.SMALL["rows"]) * (len(names) - 2)  # the two logits-only rows are unchecked
    assert all(r["bad_rows"] == 0 for r in checked)
    assert "compiles inside timed windows: 0" in capsys.readouterr().out
