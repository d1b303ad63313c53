"""The planner AOT-compiles the decode step of Qwen3.5-397B-A17B (60 layers, real dims, FP8 weights) for
one Ironwood host (tpu7x:2x2x1, 8 devices, dp8 attention + ep8 experts) at 64 running requests x 9216
tokens, and everything fits in device memory. Needs ``libtpu`` (deviceless compile; no TPU is used).
The FP8 forward is checked against ``forward_step`` on dequantised weights on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import record

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")


def test_qwen35_397b_fits_on_one_ironwood_host(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "sglang_tpu_qwen.plan", "--model-config", "qwen3.5-397b-a17b",
           "--topology", "tpu7x:2x2x1", "--dp", "8", "--ep", "8", "--max-running-requests", "64",
           "--context-length", "9216", "--fp8", "--steps", "decode", "--json", str(out)]
    # A child process: the TPU (deviceless) backend must not become the suite's default backend.
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # other processes (tests, tools) may hold libtpu's lockfile
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(proc.stdout.split("\n{")[0])
    mem = r["memory_per_device"]
    # FP8 experts: 60 layers x 512 experts x 3 x 4096 x 1024 bytes (+ scales), one eighth per device.
    assert 45 * 2**30 < mem["weights_experts"] < 50 * 2**30
    # Decode is the step with the largest footprint (whole KV pool read, 64 rows); the prefill step is
    # compiled by the CLI run (README table), which takes ~5 minutes more on 2 cores.
    for name in ("decode",):
        s = r["steps"][name]
        record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
               f"{name}: bytes accessed / minimum bytes = {s['bytes_ratio']:.2f}")
        assert s["memory"]["fits"], s["memory"]
        assert s["flops"] > 0 and s["bytes_accessed"] >= s["min_bytes"] * 0.5
    assert r["fits"]


def test_fp8_forward_is_the_model():
    """The server's step with FP8 weights (layers under scan) computes the model: it equals ``forward_step``
    on the dequantised weights (float32, 1e-5 of the largest magnitude), and every FP8 block-quantised
    matrix is within 4% (Frobenius) of the original."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sglang_tpu_qwen.model.config import Qwen35MoeConfig
    from sglang_tpu_qwen.model.embedded import embedded_config_dict, init_embedded_params
    from sglang_tpu_qwen.model.forward import forward_step, init_cache
    from sglang_tpu_qwen.parallel.fp8 import Fp8Weight, dequantize_tree, quantize_params

    d = embedded_config_dict()
    d["text_config"].update(vocab_size=512, num_hidden_layers=8, layer_types=None, full_attention_interval=4,
                            moe_intermediate_size=128, shared_expert_intermediate_size=128)
    config = Qwen35MoeConfig.from_hf_dict(d)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_embedded_params(config))
    q = quantize_params(params)
    assert isinstance(q["layers"][0]["moe"]["w_gate"], Fp8Weight)
    assert q["layers"][0]["moe"]["w_gate"].q.dtype == jnp.float8_e4m3fn
    deq = dequantize_tree(q, jnp.float32)

    b, t = 2, 5
    tokens = np.arange(1, b * t + 1, dtype=np.int32).reshape(b, t)
    args = (tokens, np.zeros(b, np.int32), np.array([5, 3], np.int32), np.array([[1, 2], [3, 4]], np.int32),
            np.array([1, 2], np.int32))
    fwd = jax.jit(functools.partial(forward_step, config=config))
    with jax.default_matmul_precision("highest"):
        ref_q, _ = fwd(deq, init_cache(config, 8, 4, 4, jnp.float32), *args)
        got, _ = fwd(q, init_cache(config, 8, 4, 4, jnp.float32), *args)
    valid = np.arange(t)[None, :] < args[2][:, None]
    ref_q, got = (np.asarray(x)[valid] for x in (ref_q, got))
    fp8_fwd_err = np.max(np.abs(got - ref_q)) / np.max(np.abs(ref_q))
    # e4m3 keeps 3 mantissa bits: each quantised matrix is within ~2.6% (Frobenius) of the original.
    # (Whole-model drift is not bounded tightly: a small change can flip a token's top-k experts.)
    errs = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            for a, b, w in zip(jax.tree.leaves(deq), jax.tree.leaves(params),
                               jax.tree.leaves(q, is_leaf=lambda x: isinstance(x, Fp8Weight)), strict=True)
            if isinstance(w, Fp8Weight)]
    fp8_err = max(errs)
    print(f"fp8 forward vs dequantised: {fp8_fwd_err:.2e}; worst FP8 matrix error: {fp8_err:.2e} "
          f"over {len(errs)} stacked matrices")
    assert fp8_fwd_err < 1e-5
    assert len(errs) >= 4 * 6 and fp8_err < 0.04
