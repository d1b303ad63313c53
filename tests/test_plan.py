"""The planner AOT-compiles the decode, prefill and speculative verify steps of Qwen3.5-397B-A17B (60 layers,
real dims, FP8 weights) for one Ironwood host (tpu7x:2x2x1, 8 devices, dp8 attention + ep8 experts) at 64
running requests x 9216 tokens (prefill: the default 1024 tokens per DP rank), everything fits in device
memory, and the decode and prefill steps move at most issue 11's bound of bytes. The report carries issue 33's
figures: per step the mean and slowest device, the collectives charged over the ICI, both units per workload
and the calibration against the published measurements (their arithmetic is checked by hand in
tests/test_plan_compose.py), and issue 27's plan with MTP at accept length 3.2 beside the plan without it.
Needs ``libtpu`` (deviceless compile; no TPU is used).
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
    cmd = [sys.executable, "-m", "sglang_tpu_qwen.tools.plan", "--model-config", "qwen3.5-397b-a17b",
           "--topology", "tpu7x:2x2x1", "--dp", "8", "--ep", "8", "--max-running-requests", "64",
           "--context-length", "9216", "--fp8", "--speculative-num-draft-tokens", "4",
           "--speculative-accept-length", "3.2", "--json", str(out)]
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
    # The server's memory rule on 96 GiB a device: KV for every row's context, the GDN snapshot slots what
    # --mem-fraction-static leaves after the weights and the KV (engine/runner/memory_split.py).
    split = mem["split"]
    assert split["rule"] == "after the KV pool" and split["over_budget_bytes"] == 0
    room = (split["budget_bytes"] - split["kv_pool_bytes"]) // split["state_slot_bytes"]
    assert mem["gdn_snapshot_slots"] == room - 9 > 0
    # Issue 11's bounds: bytes accessed at most 1.3x the bytes the step must move at decode, 2x at prefill.
    for name, bound in (("decode", 1.3), ("prefill", 2.0)):
        s = r["steps"][name]
        record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
               f"{name}: bytes accessed / minimum bytes = {s['bytes_ratio']:.2f}")
        assert s["memory"]["fits"], s["memory"]
        # The server's program: Pallas attention, fused GDN and the FP8 grouped matmul, whose declared
        # traffic (weights read once as FP8) is most of the step's bytes.
        assert r["kernels"] == {"attention": "pallas", "gdn": "pallas", "fp8_matmul": "pallas"}
        assert s["bytes_kernels"] > 0.8 * s["min_bytes"]
        # No dequantised copy of a layer's weights in temporaries (one layer's FP8 experts alone are 0.75 GiB
        # per device).
        assert s["min_bytes"] <= s["bytes_accessed"] <= bound * s["min_bytes"], (name, s["bytes_ratio"])
        assert s["memory"]["temp"] < 0.75 * 2**30, s["memory"]
        assert len(s["top_excess"]) >= 3 and all(e["bytes"] > 0 for e in s["top_excess"])
    assert r["prefill_tokens_per_rank"] == 1024 and r["steps"]["prefill"]["bucket"]["tokens"] == 1024
    assert [w["name"] for w in r["workloads"]] == ["1k in / 8k out", "8k in / 1k out"]
    assert r["fits"] and r["memory"]["fits"]
    # Issue 33: per step the mean and the slowest device side by side (uniform and Zipf routing), and the
    # collectives of the compiled HLO over the ICI: 2 all-gathers and 2 reduce-scatters per layer.
    for name in ("decode", "prefill"):
        s = r["steps"][name]
        for dist in ("uniform", "zipf"):
            assert s["slowest_device_s"][dist] >= s["mean_device_s"][dist] > 0, (name, dist)
            e = s["moe_extra"][dist]
            for key in ("mean_experts", "max_experts", "max_pairs"):  # analytic vs the report's Monte-Carlo
                assert abs(e["analytic"][key] - e["monte_carlo"][key]) <= 0.03 * e["analytic"][key], (name, key, e)
        cl = s["collective_s"]
        assert cl["count"] == 4 * 60 and 0 < cl["exposed"] <= cl["total"], cl
        assert cl["exposed_low"] <= cl["exposed"] <= cl["exposed_high"]
        assert s["planned_s"]["uniform"] >= s["compiled_time_s"] + cl["exposed"]
        record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
               f"{name}: mean / slowest device {s['mean_device_s']['uniform'] * 1e3:.2f} / "
               f"{s['slowest_device_s']['uniform'] * 1e3:.2f} ms, collectives exposed {cl['exposed'] * 1e3:.2f} ms")
    # The decode step of 64 tokens: the slowest of 8 devices touches ~51 of its 64 experts, the mean ~45.9.
    dec = r["steps"]["decode"]["moe_extra"]["uniform"]["analytic"]
    assert 45.5 < dec["mean_experts"] < 46.5 and 50.5 < dec["max_experts"] < 51.5
    # Both units per workload; the calibration against both published measurements.
    for w in r["workloads"]:
        for kind in ("roofline", "planned", "planned_zipf"):
            assert w[kind]["total_tok_s_chip"] > 0 and w[kind]["decode_output_tok_s_chip"] > 0
        assert w["planned"]["total_tok_s_chip"] < w["roofline"]["total_tok_s_chip"]
        assert (w["planned_ici_slow"]["total_tok_s_chip"] <= w["planned"]["total_tok_s_chip"]
                <= w["planned_ici_fast"]["total_tok_s_chip"])
    # Issue 27: the served speculative decode step (the verify forward over 64 x 4 tokens, the GDN commit, the
    # MTP layer's draft program and the sampling of the 256 positions) fits, moves more than a decode step
    # and yields 3.2 tokens a request; the plan without speculation comes from the same compile.
    v = r["steps"]["verify"]
    assert v["memory"]["fits"] and v["new_tokens_per_row"] == 4 and r["speculative"]["num_draft_tokens"] == 4
    assert v["min_bytes"] > r["steps"]["decode"]["min_bytes"] and v["planned_s"]["uniform"] > 0
    assert r["speculative"]["mtp_weights_experts"] > 0  # the MTP layer's experts, split over EP
    plain = {w["name"]: w["tok_s_chip"] for w in r["workloads_without_speculation"]}
    spec = {w["name"]: w["tok_s_chip"] for w in r["workloads"]}
    assert all(w["decode_step"] == "verify" and w["tokens_per_decode_step"] == 3.2 for w in r["workloads"])
    for name in plain:
        record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
               f"{name}: planned {plain[name]:.0f} total tok/s/chip without MTP, {spec[name]:.0f} with MTP at "
               f"accept length 3.2 ({spec[name] / plain[name]:.2f}x)")
    record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
           f"verify: forward bytes / its minimum = {v['forward_bytes_ratio']:.2f}, step bytes / minimum = "
           f"{v['bytes_ratio']:.2f}, planned {v['planned_s']['uniform'] * 1e3:.2f} ms")
    assert v["forward_bytes_ratio"] <= 1.3  # issue 27's bound for the verify forward (the step adds the drafts)
    assert spec["1k in / 8k out"] > plain["1k in / 8k out"]
    cal = r["calibration"]["workloads"]
    assert {k: v["measured"] for k, v in cal.items()} == {"1k in / 8k out": 677, "8k in / 1k out": 3707}
    for name, c in cal.items():
        assert c["predicted"] > 0 and c["efficiency"] == c["measured"] / c["predicted"], (name, c)
        record("Planner: Qwen3.5-397B-A17B on tpu7x:2x2x1",
               f"{name}: predicted {c['predicted']:.0f} vs measured {c['measured']} total tok/s/chip")

