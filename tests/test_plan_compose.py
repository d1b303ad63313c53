"""The planner's arithmetic, checked by hand on small configurations (no compile, no libtpu):

- compose_workloads: a workload in total (input + output) and decode-only output tok/s/chip from made-up steps,
  against the same arithmetic written out here, with requests split over DP ranks (dp 2 on 8 devices: 32
  rows per rank, not 8 per device) and the later chunks of a long prompt charged their prefix;
- routing: the slowest device's distinct experts and (token, expert) pairs, analytic against a fixed-seed
  Monte-Carlo, uniform and Zipf, within a stated tolerance; the uniform mean in closed form;
- chips.collective_time: an all-gather and a reduce-scatter on a 2x2 slice of two-core chips by hand;
- calibration: the blog's discount in its roofline's unit;
- capacity: concurrent and idle sessions per host from a tiny config's cache units written out by hand, and the
  per-device weights split ep ways.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
from conftest import tiny_hybrid_config

from sglang_tpu_qwen.tools import plan
from sglang_tpu_qwen.tools.plan import capacity, chips, routing

CHIP = plan.CHIPS["tpu7x"]
BW = 7380e9 / 2  # per TensorCore
PEAK = 2307e12 / 2
KV = 1000  # KV bytes per token (made up)
ATTN = 15 * 2 * 2 * 32 * 256  # attention flops per token per visible key, 397B config (15 attention layers)


def _step(context: int, hlo: float, minimum: float, flops: float, slow: float, coll: float) -> dict:
    return {"context": context, "new_tokens_per_row": 1, "bytes_accessed": hlo, "min_bytes": minimum, "flops": flops,
            "serial_s": max(hlo / BW, flops / PEAK) + 1e-3,
            "moe_extra": {"uniform": {"slowest_bytes": slow, "slowest_flops": 0.0},
                          "zipf": {"slowest_bytes": 2 * slow, "slowest_flops": 1e12}},
            "collective_s": {"exposed": coll, "exposed_low": coll / 2, "exposed_high": 2 * coll}}


def _report(dp: int) -> dict:
    return {"steps": {"decode": _step(9216, 40e9, 36e9, 1e12, 3.69e9, 2e-3),
                      "prefill": _step(4096, 100e9, 50e9, 40e15, 0.0, 30e-3)},
            "dp": dp, "chips": 4, "devices": 8, "prefill_tokens_per_rank": 4096, "max_running_requests": 64,
            "model": {"fp8": True}, "ep": 8}


@pytest.fixture(scope="module")
def config():
    return plan.load_model_config("qwen3.5-397b-a17b")


def test_workloads_by_hand_dp_ranks_not_devices(config):
    w1, w8 = plan.compose_workloads(_report(dp=2), CHIP, config, kv_per_token=KV)
    # 1k in / 8k out, dp 2: 32 requests per rank. Decode at the average context 1024 + 4096 = 5120.
    rows = 64 / 2
    kv_delta = rows * (5120 - 9216) * KV
    fl_delta = rows * ATTN * (5120 - 9216)
    t_roof = max((36e9 + kv_delta) / BW, (1e12 + fl_delta) / PEAK)
    # Planned: the serial time, the extra KV bytes and flops, the slowest device's extra experts, collectives.
    t_plan = 40e9 / BW + 1e-3 + kv_delta / BW + fl_delta / PEAK + 3.69e9 / BW + 2e-3
    assert w1["roofline"]["decode_step_s"] == pytest.approx(t_roof, rel=1e-9)
    assert w1["planned"]["decode_step_s"] == pytest.approx(t_plan, rel=1e-9)
    assert w1["roofline"]["decode_output_tok_s_chip"] == pytest.approx(64 / t_roof / 4, rel=1e-9)
    # Prefill: 64 prompts of 1024 over 2 ranks of 4096 tokens a step = 8 steps, one chunk each (prefix 0).
    assert w1["prefill_steps"] == 8 and w1["chunk_prefixes"] == [0]
    p_roof = max(50e9 / BW, 40e15 / PEAK)
    p_plan = 40e15 / PEAK + 1e-3 + 30e-3
    assert w1["planned"]["prefill_step_s"] == pytest.approx(p_plan, rel=1e-9)
    # The collectives at the slow end of the ICI assumptions: twice the exposed time here.
    assert w1["planned_ici_slow"]["prefill_step_s"] == pytest.approx(p_plan + 30e-3, rel=1e-9)
    assert w1["planned_ici_fast"]["decode_step_s"] == pytest.approx(t_plan - 1e-3, rel=1e-9)
    total = 64 * (1024 + 8192)
    assert w1["roofline"]["total_tok_s_chip"] == pytest.approx(total / (8 * p_roof + 8192 * t_roof) / 4, rel=1e-9)
    assert w1["planned"]["total_tok_s_chip"] == pytest.approx(total / (8 * p_plan + 8192 * t_plan) / 4, rel=1e-9)
    # The two units differ by the input tokens and the prefill time.
    assert w1["roofline"]["total_tok_s_chip"] != pytest.approx(w1["roofline"]["decode_output_tok_s_chip"], rel=0.05)
    # 8k in / 1k out: 64 * 8192 / (2 * 4096) = 64 steps; a prompt is two chunks, the second with a 4096-token
    # prefix: its attention flops (and, in the roofline, its KV read).
    assert w8["prefill_steps"] == 64 and w8["chunk_prefixes"] == [0, 4096]
    p2_roof = max((50e9 + 4096 * KV) / BW, (40e15 + 4096 * ATTN * 4096) / PEAK)
    assert w8["roofline"]["prefill_step_s"] == pytest.approx((p_roof + p2_roof) / 2, rel=1e-9)
    assert w8["roofline"]["prompt_tok_s_chip"] == pytest.approx(2 * 4096 / ((p_roof + p2_roof) / 2) / 4, rel=1e-9)
    # dp 8 on the same 8 devices: 8 requests per rank, a smaller KV delta; the old per-device split would have
    # given dp 2 this figure too.
    w1_dp8 = plan.compose_workloads(_report(dp=8), CHIP, config, kv_per_token=KV)[0]
    t8 = max((36e9 + 8 * (5120 - 9216) * KV) / BW, (1e12 + 8 * ATTN * (5120 - 9216)) / PEAK)
    assert w1_dp8["roofline"]["decode_step_s"] == pytest.approx(t8, rel=1e-9)
    assert w1_dp8["roofline"]["decode_step_s"] != pytest.approx(t_roof, rel=1e-3)
    # The skewed routing charges its own slowest device.
    assert w1["planned_zipf"]["decode_step_s"] == pytest.approx(
        t_plan + 3.69e9 / BW + 1e12 / PEAK, rel=1e-9)


def test_speculative_workload_by_hand(config):
    """MTP: a verify step feeding 4 tokens a row yields the accept length (3.2) a request, so 8k out takes
    8192 / 3.2 such steps; its attention reads the context once and computes it for each fed token."""
    report = _report(dp=8)
    report["steps"]["verify"] = dict(_step(9219, 44e9, 38e9, 4e12, 3.69e9, 2e-3), new_tokens_per_row=4)
    w1 = plan.compose_workloads(report, CHIP, config, KV, decode_step="verify", tokens_per_step=3.2)[0]
    rows = 64 / 8
    kv_delta = rows * (5120 - 9219) * KV
    fl_delta = rows * 4 * ATTN * (5120 - 9219)
    t_plan = max(44e9 / BW, 4e12 / PEAK) + 1e-3 + kv_delta / BW + fl_delta / PEAK + 3.69e9 / BW + 2e-3
    assert w1["planned"]["decode_step_s"] == pytest.approx(t_plan, rel=1e-9)
    assert w1["decode_steps"] == pytest.approx(8192 / 3.2) and w1["decode_step"] == "verify"
    p_plan = max(100e9 / BW, 40e15 / PEAK) + 1e-3 + 30e-3  # 2 prefill steps of one 4096-token chunk per rank
    total = 64 * (1024 + 8192)
    assert w1["planned"]["total_tok_s_chip"] == pytest.approx(total / (2 * p_plan + 8192 / 3.2 * t_plan) / 4,
                                                              rel=1e-9)
    assert w1["tok_s_chip"] == w1["planned"]["total_tok_s_chip"]
    assert w1["planned"]["decode_output_tok_s_chip"] == pytest.approx(64 * 3.2 / t_plan / 4, rel=1e-9)


def test_workloads_are_composed_only_at_their_concurrency(config):
    """The public workloads run 64 requests: a plan of 512-row steps must not charge them a 512-row step."""
    report = _report(dp=8)
    assert [w["name"] for w in plan.compose_workloads(report, CHIP, config, KV)] == [w["name"] for w in plan.WORKLOADS]
    report["max_running_requests"] = 512
    assert plan.compose_workloads(report, CHIP, config, KV) == []


# Analytic against Monte-Carlo (fixed seed): within 3% relative. The analytic treats experts as independent
# (device counts) and pair counts as normal; both are small errors at these sizes (measured: < 1%).
TOL = 0.03


@pytest.mark.parametrize("dist", routing.DISTRIBUTIONS, ids=lambda d: d.label)
@pytest.mark.parametrize("tokens", [16, 64])
def test_slowest_device_analytic_vs_monte_carlo(dist, tokens):
    e, k, ep = 64, 4, 4
    a = routing.expert_load(e, k, ep, tokens, dist)
    mc = routing.monte_carlo(e, k, ep, tokens, dist, trials=1500, seed=0)
    for key in ("mean_experts", "max_experts", "mean_pairs", "max_pairs"):
        assert a[key] == pytest.approx(mc[key], rel=TOL), (key, a, mc)
    assert a["max_experts"] > a["mean_experts"] and a["max_pairs"] > a["mean_pairs"]
    assert a["mean_pairs"] == pytest.approx(tokens * k / ep)


def test_uniform_mean_in_closed_form_and_the_397b_decode_step():
    # 64 tokens x top-10 over 512 experts on EP 8: a device touches 64 * (1 - (1 - 10/512)^64) = 45.9 of its
    # 64 experts on average, the slowest of 8 about 51 (issue 33's reconciliation).
    a = routing.expert_load(512, 10, 8, 64, routing.UNIFORM)
    assert a["mean_experts"] == pytest.approx(64 * (1 - (1 - 10 / 512) ** 64), rel=1e-9)
    assert 50.5 < a["max_experts"] < 51.5
    with pytest.raises(ValueError):
        routing.expert_load(512, 10, 7, 64, routing.UNIFORM)


def test_collective_time_by_hand():
    ici = chips.TPU7X_ICI
    two_by_two = [(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 0), (1, 1, 0), (1, 1, 0)]
    link = 1.2e12 / 6 / 2  # one link, one direction
    # All-gather of a 512 KiB result over all 8 devices: 4 chips of 2; each chip takes in 2 * 3/4 of it over its
    # 2 neighbours' links, each device half of it from its sibling core; 2 hops across the diagonal.
    b = 512 * 1024
    ag = chips.collective_time("all-gather", b / 8, b, two_by_two, ici)
    assert ag["ici_bytes_per_chip"] == 2 * 0.75 * b
    assert ag["s"] == pytest.approx(5e-6 + 2 * 1e-6 + 1.5 * b / (2 * link) + 0.5 * b / 400e9, rel=1e-12)
    # Reduce-scatter between a chip's two cores: no ICI, the die-to-die link only, no hops.
    t = chips.collective_time("reduce-scatter", b, b / 2, two_by_two[:2], ici)
    assert t["ici_bytes_per_chip"] == 0 and t["s"] == pytest.approx(5e-6 + 0.5 * b / 400e9, rel=1e-12)
    # The slow end of the assumptions is slower than the fast end.
    lo = chips.collective_time("all-gather", b / 8, b, two_by_two, ici, "low")["s"]
    hi = chips.collective_time("all-gather", b / 8, b, two_by_two, ici, "high")["s"]
    assert lo < ag["s"] < hi


def test_blog_discount_in_the_rooflines_unit():
    w1k, w8k = plan.WORKLOADS
    # 677 total tok/s/chip at 1k in / 8k out is 677 * 8192 / 9216 = 601.8 output tok/s/chip; 978 is output-only.
    assert plan.calibration.blog_discount(w1k) == pytest.approx(677 * 8192 / 9216 / 978)
    assert plan.calibration.blog_discount(w8k) == pytest.approx(3707 / 5170)
    assert math.isclose(64 / 16.36e-3 / 4, 978, rel_tol=1e-3)  # the blog's decode roofline, as reconstructed


def test_prompt_rate_the_measurements_imply():
    # 1k / 8k: 64 * 9216 tokens / (677 * 4 chips) = 217.8 s over 8192 decode steps = 26.6 ms a step. 8k / 1k:
    # 64 * 9216 / (3707 * 4) = 39.8 s, of which 1024 decode steps are 27.2 s: 12.6 s of prefill for
    # 64 * 8192 prompt tokens = 10.4k prompt tok/s/chip (issue 33's "about 10k").
    r = plan.calibration.implied_prompt_rate()
    step = 64 * 9216 / (677 * 4) / 8192
    assert r["decode_step_s"] == pytest.approx(step, rel=1e-12)
    assert r["prompt_tok_s_chip"] == pytest.approx(64 * 8192 / (64 * 9216 / (3707 * 4) - 1024 * step) / 4, rel=1e-12)
    assert 10_000 < r["prompt_tok_s_chip"] < 11_000


_tiny_config = tiny_hybrid_config


@pytest.mark.parametrize("kv, state", [("bfloat16", "float32"), ("fp8_e4m3", "bfloat16")])
def test_capacity_row_by_hand(kv, state):
    c = _tiny_config()
    kv_item, st_item = {"bfloat16": 2, "fp8_e4m3": 1}[kv], {"float32": 4, "bfloat16": 2}[state]
    # K and V of 1 attention layer x 2 heads x 16 dims per token; conv [2*2*8 + 4*6, 3] + rec [4, 8, 6] x 3 layers.
    kv_token = 2 * 1 * 2 * 16 * kv_item
    st = 3 * ((2 * 2 * 8 + 4 * 6) * 3 + 4 * 8 * 6) * st_item
    # 100 tokens at page 16: 7 pages. Budget 0.5 x 1 MiB - 100 KiB on each of 4 devices.
    budget = (1 << 19) - 100 * 1024
    per = 7 * 16 * kv_token + st
    r = capacity.capacity_row(c, kv_dtype=capacity.KV_DTYPES[kv], state_dtype=capacity.STATE_DTYPES[state],
                              page_size=16, session_tokens=100, hbm_per_device=1 << 20, mem_fraction_static=0.5,
                              weight_bytes=100 * 1024, devices=4, running_per_host=6, host_bytes=1e6)
    assert (r["kv_per_token"], r["state"], r["session_kv"]) == (kv_token, st, 7 * 16 * kv_token)
    assert r["concurrent"] == 4 * (budget // per)
    assert r["idle_hbm"] == 4 * ((budget - 2 * per) // per)  # 6 running over 4 devices: 2 on the fullest
    assert r["idle_states_host"] == int(1e6 // st) and r["idle_sessions_host"] == int(1e6 // per)
    with pytest.raises(ValueError, match="leave nothing"):
        capacity.capacity_row(c, kv_dtype=jnp.bfloat16, state_dtype=jnp.float32, page_size=16, session_tokens=100,
                              hbm_per_device=1 << 20, mem_fraction_static=0.5, weight_bytes=1 << 19, devices=4,
                              running_per_host=0, host_bytes=0)


def test_capacity_weights_are_the_planners():
    # Per-device weights: replicated leaves whole, expert stacks split ep ways (programs.weight_bytes_per_device).
    c = _tiny_config()
    w1, w4 = capacity.weights_per_device(c, 1, fp8=False), capacity.weights_per_device(c, 4, fp8=False)
    experts = 4 * 3 * 4 * 32 * 16 * 2  # 4 layers x (gate, up, down) x 4 experts x 32 x 16 bf16
    assert w1 - w4 == experts - experts // 4
    t = capacity.capacity_table(plan.load_model_config("qwen3.5-397b-a17b"))
    assert t["devices"] == 8 and t["host_ram"] == 960e9
    rows = {(r["state_dtype"], r["kv_dtype"]): r for r in t["rows"]}
    # The 397B layout: 15 attention layers x K, V x 2 KV heads x 256 dims; 45 GDN layers of [64,128,128] + conv.
    assert rows["float32", "bfloat16"]["kv_per_token"] == 15 * 2 * 2 * 256 * 2
    assert rows["float32", "bfloat16"]["state"] == 45 * (64 * 128 * 128 + 12288 * 3) * 4
    assert rows["bfloat16", "fp8_e4m3"]["concurrent"] > rows["float32", "bfloat16"]["concurrent"]
