"""bench_offline_throughput: prompt sampling, and one small real run of Engine vs HF transformers."""

from __future__ import annotations

import json

import pytest

from sglang_tpu_qwen.bench.offline_throughput import NORMAL_ID_LIMIT, main, sample_random_prompts


def test_random_prompts_are_seeded_and_in_range():
    prompts = sample_random_prompts(50, 40, 0.5, seed=7)
    assert prompts == sample_random_prompts(50, 40, 0.5, seed=7)
    assert prompts != sample_random_prompts(50, 40, 0.5, seed=8)
    lens = [len(p) for p in prompts]
    assert min(lens) >= 20 and max(lens) <= 40 and len(set(lens)) > 1
    ids = [t for p in prompts for t in p]
    assert min(ids) >= 0 and max(ids) < NORMAL_ID_LIMIT
    assert {len(p) for p in sample_random_prompts(5, 16, 1.0, seed=0)} == {16}
    with pytest.raises(ValueError):
        sample_random_prompts(2, 16, 1.5, seed=0)


def test_small_run_reports_both_throughputs(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "result.json"
    result = main(["--num-prompts", "2", "--seed", "1", "--random-input-len", "16", "--random-output-len", "4",
                   "--hf-batch-size", "2", "--max-running-requests", "4", "--output-json", str(out)])
    assert json.loads(out.read_text()) == result
    eng, hf = result["engine"], result["hf"]
    for side in (eng, hf):
        assert side["output_throughput"] > 0 and side["total_throughput"] > side["output_throughput"]
        assert side["total_output_tokens"] == 2 * 4  # min_new_tokens == max_new_tokens: exactly 4 each
        assert side["output_throughput"] == pytest.approx(side["total_output_tokens"] / side["elapsed_s"])
    # Programs compiled at startup; warm-up prompts differ from the timed ones: the timed run compiles nothing.
    assert eng["compilations_during_timed_run"] == 0
    assert eng["decode_steps"] > 0 and eng["decode_device_ms"] > 0
    assert eng["decode_step_ms"] == pytest.approx(eng["decode_device_ms"] + eng["decode_host_ms"]) or (
        eng["decode_host_ms"] == 0.0)
    # Device idle waiting for the host (bench/device_idle.py), from a second run with the meter attached: a
    # share of that run's decode wall time.
    assert eng["decode_idle_ms"] >= 0.0 and 0.0 <= eng["decode_idle_pct"] <= 100.0
    assert eng["metered_output_throughput"] > 0
    assert result["output_throughput_ratio"] == pytest.approx(eng["output_throughput"] / hf["output_throughput"])
    assert result["total_throughput_ratio"] == pytest.approx(eng["total_throughput"] / hf["total_throughput"])
    assert result["total_input_tokens"] == sum(len(p) for p in sample_random_prompts(2, 16, 0.0, seed=1))
    if result["backends"]["jax"] == "cpu":
        # Both sides run fp32 here (the Engine picks bf16 only on accelerators), so greedy tokens agree; a
        # mismatch would point at HF's left padding or our batching rather than at rounding.
        assert result["greedy_identical"] == 2
