"""bench.mxu_chain on the CPU (Pallas interpret mode): each chain is multiplied the given number of times, and
the sweep prints a line per (dtype, size, chains)."""

import numpy as np

from sglang_tpu_qwen.bench import mxu_chain


def test_chains_multiply_products_times():
    x, m = mxu_chain.chain_inputs(16, 2)
    out = mxu_chain.mxu_chain(x, m, products=3, steps=2, bf16=False, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 0.99**3, rtol=1e-6, atol=1e-6)
    out16 = mxu_chain.mxu_chain(x, m, products=3, steps=2, bf16=True, interpret=True)
    np.testing.assert_allclose(np.asarray(out16), np.asarray(x) * 0.99**3, rtol=2e-2, atol=2e-2)  # bf16 operands


def test_small_sweep_prints_every_case(capsys):
    mxu_chain.main(["--small"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "a product in a chain" in line]
    assert len(lines) == 2 * 2 * 2  # dtypes x sizes x chain counts
