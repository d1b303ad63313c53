"""The planner AOT-compiles the decode step of Qwen3.5-397B-A17B (60 layers, real dims, FP8 weights) for
one Ironwood host (tpu7x:2x2x1, 8 devices, dp8 attention + ep8 experts) at 64 running requests x 9216
tokens, and everything fits in device memory. Needs ``libtpu`` (deviceless compile; no TPU is used).
The FP8 forward itself is checked on CPU by tests/test_fp8_matmul.py."""

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
