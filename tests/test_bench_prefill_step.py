"""The prefill benchmark (bench/prefill_step.py, issue 44) on the session's CPU engine (embedded model): the steps it
replays are the ones the scheduler runs for such prompts (the same buckets, chunks and programs, in order), its
timed windows compile nothing, its flops per token are the planner's (tools/plan/build.py "prefill") and the
analytic per-position sum, and the planner's deviceless v5e prefill step stands beside it where libtpu is
installed. No timing is asserted."""

from __future__ import annotations

import importlib.util
import os

# The deviceless v5e compile loads libtpu beside other processes (see test_kernels_aot_ironwood.py).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import record  # noqa: E402

from sglang_tpu_qwen.bench import prefill_step  # noqa: E402
from sglang_tpu_qwen.tools.plan.flops import analytic_flops_per_token  # noqa: E402

# On the session engine (page 16, chunks of 256, 4 running): 4 x 100 runs three steps (4 x 64 from 0, 4 x 32 to the
# snapshot page at 96, 4 x 4 sampling); 1 x 256 is the planner's own prefill shape (one 256-token chunk from 0),
# which the scheduler runs as 240 tokens to the snapshot page, then 16.
SHAPES = "4x100,1x256"


@pytest.fixture(scope="module")
def measured(engine: Any) -> dict[str, Any]:
    """``measure`` as the command runs it (1 x 1 timed prefills, each step alone too), on the session engine."""
    ns, _ = prefill_step.parse_args(["--model-path", "embedded", "--shapes", SHAPES, "--iters", "1", "--windows",
                                     "1", "--step-iters", "1"])
    return prefill_step.measure(engine, ns)


def test_replay_counts_and_compiles_nothing(engine, measured) -> None:
    """Every shape: 0 compilations in the timed windows, positive times, the flops per token the planner's count
    for a prompt (``L`` tokens at the analytic flops of their mean context plus one lm_head row) and, within the
    truncation of that mean, the per-position sum and the sum over the replayed steps' real rows; the tables
    render."""
    c = engine.runner.config
    head = 2 * c.hidden_size * c.vocab_size
    for r in measured["shapes"]:
        rows, length = r["rows"], r["length"]
        assert r["compilations"] == 0
        assert r["device_s"] > 0 and r["dispatch_s"] > 0 and all(d["device_s"] > 0 for d in r["steps"])
        assert r["tokens"] == rows * length == sum(d["tokens"] for d in r["steps"])
        want = length * analytic_flops_per_token(c, int((length + 1) / 2)) + head
        assert r["flops_per_token"] == pytest.approx(want / length, rel=1e-12)
        per_position = sum(analytic_flops_per_token(c, p) for p in range(1, length + 1)) + head
        assert r["flops_per_token"] == pytest.approx(per_position / length, rel=1e-3)
        assert r["step_flops"] == pytest.approx(r["flops"], rel=1e-3)
        assert r["roofline_over_measured"] == pytest.approx(r["compute_roofline_s"] / r["device_s"])
        assert r["bytes"] > 0 and r["bound"] in ("compute", "HBM")
    first = measured["shapes"][0]
    assert [(d["bucket"][:2], d["tokens"], d["prefix"], d["sampled"]) for d in first["steps"]] == [
        ([4, 64], 256, [0, 0], 0), ([4, 64], 128, [64, 64], 0), ([4, 16], 16, [96, 96], 4)]
    text = prefill_step.format_table(measured)
    assert "| 4 x 100 | 3 |" in text and "Steps of 1 x 256" in text
    record("Prefill replay: CPU, embedded model", "; ".join(
        f"{r['rows']} x {r['length']}: {r['num_steps']} steps, {r['device_s'] * 1e3:.1f} ms, "
        f"{r['flops_per_token'] / 1e6:.2f} MFLOP / token, 0 compilations" for r in measured["shapes"]))


def test_replay_runs_the_served_steps(engine, measured) -> None:
    """Greedy prompts of the first shape served together (one token each) run exactly the replayed steps: the
    same forward buckets with the same chunks and prefixes row by row, and the same compiled programs in the same
    order (forward, forward, forward, sampling, keep-sampled)."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs

    runner = engine.runner
    first = measured["shapes"][0]
    rows, length = first["rows"], first["length"]
    steps = prefill_step.scheduled_steps(engine, rows, length)
    served: list[tuple] = []
    forward = runner.forward

    def spy(batch: Any) -> Any:
        served.append((batch.input_ids.shape, batch.prefix_lens.tolist(), batch.extend_lens.tolist()))
        return forward(batch)

    prompts = [np.random.default_rng(100 + i).integers(1000, 200000, size=length).tolist() for i in range(rows)]
    runner.forward = spy  # type: ignore[method-assign]
    try:
        with recorded_programs(runner) as keys:
            outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1})
    finally:
        del runner.forward
    assert all(len(o["output_ids"]) == 1 for o in outs)
    assert served == [(b.forward.input_ids.shape, b.forward.prefix_lens.tolist(), b.forward.extend_lens.tolist())
                      for b in steps.batches]
    assert [str(k) for k in keys] == first["programs"]
    assert first["programs"][:3] == [str(("forward", runner.buckets.extend_bucket(4, n)[0])) for n in (64, 32, 4)]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_planned_v5e_prefill_beside_the_replay(engine, measured) -> None:
    """The planner's v5e prefill step (``plan_all`` after the measurement, deviceless ``v5e:1x1``, the engine's
    chunk of 256) counts the same flops per token as the benchmark for its own shape, 1 x 256, and is set beside
    every shape per token."""
    ns, _ = prefill_step.parse_args(["--model-path", "embedded", "--shapes", SHAPES])
    result = {**measured, "shapes": [dict(r) for r in measured["shapes"]]}
    prefill_step.plan_all(ns, result, engine.runner.config)
    p = result["plan"]
    assert "error" not in p, p
    assert result["plan_topology"] == "v5e:1x1" and p["bucket"]["batch"] == 1 and p["tokens"] == 256
    assert p["kernels"]["attention"] == "pallas" and p["kernels"]["gdn"] == "pallas"
    (one,) = [r for r in result["shapes"] if (r["rows"], r["length"]) == (1, 256)]
    assert one["flops_per_token"] == pytest.approx(p["analytic_flops"] / p["tokens"], rel=1e-12)
    assert p["planned_s"] >= p["serial_s"] > 0 and p["planned_per_token_s"] == p["planned_s"] / 256
    text = prefill_step.format_table(result)
    assert "Plan (v5e:1x1, tools.plan)" in text
    record("Prefill: the planner on v5e:1x1", f"embedded model, 1 x 256 chunk: planned {p['planned_s'] * 1e3:.3f} ms, "
           f"{p['analytic_flops'] / p['tokens'] / 1e6:.2f} MFLOP / token (= the benchmark's)")


def test_profile_of_replayed_prefills(engine, tmp_path) -> None:
    """``--profile`` on a CPU: no device plane, so the host plane's XLA ops of the replayed prefill's programs,
    grouped by decode_step's categories, per prefill."""
    prof = prefill_step.profile_prefill(engine, 1, 100, 1, tmp_path)
    assert prof["source"] == "host" and prof["total_ms_per_step"] > 0 and prof["unit"] == "prefill"
    assert {o["module"] for o in prof["top_ops"]} <= {"jit_forward_program", "jit_sample_program",
                                                      "jit_keep_sampled", "jit_head_rows"}
    assert all(o["opcode"] for o in prof["top_ops"])
    text = prefill_step.format_table({**_empty_result(engine), "profile": prof})
    assert "1 replayed prefills of 1 x 100" in text and "ms / prefill" in text


def _empty_result(engine: Any) -> dict[str, Any]:
    """A result without shapes (format_table's header only)."""
    import dataclasses

    from sglang_tpu_qwen.bench import decode_step
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    info = decode_step.settle_engine(engine)
    info.update(chunked_prefill_size=256, radix_cache=True, overlap=True)
    return {"model": "m", "device_kind": "cpu", "platform": "cpu", "jax": "x", "chip": dataclasses.asdict(CHIPS["v5e"]),
            "on_chip": False, "windows": 1, "iters": 1, "engine": info, "shapes": []}


def test_flags() -> None:
    """Defaults: the 35B-shaped checkpoint, 64 x 512 and 8 x 4096, running requests for the largest R; "embedded"
    is the embedded model; a bad shape exits."""
    ns, args = prefill_step.parse_args([])
    assert ns.shape_list == [(64, 512), (8, 4096)] and args.max_running_requests == 64
    assert args.model_path == "shaped-35b" and ns.profile_shape == (64, 512)
    ns, args = prefill_step.parse_args(["--model-path", "embedded", "--shapes", "2x40", "--profile-shape", "4x16"])
    assert args.model_path is None and ns.shape_list == [(2, 40)] and args.max_running_requests == 4
    for bad in ("0x512", "64x1", "64"):
        with pytest.raises(SystemExit):
            prefill_step.parse_args(["--shapes", bad])
