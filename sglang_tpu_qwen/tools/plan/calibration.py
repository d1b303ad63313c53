"""The public Ironwood figures for Qwen3.5-397B-A17B and the planner's calibration against them.

The published figures (the SGLang-JAX team's Ironwood write-up, as reconciled in issue 33): Qwen3.5-397B-A17B,
FP8 weights, 4 chips (8 TensorCores) with DP attention + EP MoE, 1,024 batched tokens per core, up to 64
sequences per core, a benchmark of 64 concurrent requests:
- measured: 677 tok/s/chip at 1k in / 8k out and 3,707 at 8k in / 1k out, total (input + output) tokens;
- rooflines: 978 for 1k / 8k is decode-only output tokens (64 tokens per decode step / 16.36 ms / 4 chips);
  5,170 for 8k / 1k has no public formula: its unit is not stated, set here beside total tok/s/chip.
The blog discounts its rooflines to its measurements: measured / roofline, in the roofline's own unit where
it can be converted (677 total at 1k / 8k is 677 * 8192 / 9216 = 602 output tok/s/chip, 0.615 of 978).
"""

from __future__ import annotations

from typing import Any

CONCURRENCY = 64
WORKLOADS = (
    {"name": "1k in / 8k out", "input": 1024, "output": 8192,
     "published": {"measured_total_tok_s_chip": 677, "roofline": 978, "roofline_unit": "decode-only output tok/s/chip",
                   "roofline_definition": "64 tokens / 16.36 ms decode step / 4 chips"}},
    {"name": "8k in / 1k out", "input": 8192, "output": 1024,
     "published": {"measured_total_tok_s_chip": 3707, "roofline": 5170, "roofline_unit": "unstated (set beside total)",
                   "roofline_definition": "no public formula"}},
)  # fmt: skip

# The blog's final configuration, as far as it is public.
BLOG_CONFIG = {
    "chips": 4, "dp": 8, "ep": 8, "prefill_tokens_per_core": 1024, "max_sequences_per_core": 64, "fp8_weights": True,
    "kv_cache": "bf16 (this server has no --kv-cache-dtype)", "concurrency": CONCURRENCY,
}  # fmt: skip


def blog_discount(w: dict[str, Any]) -> float:
    """The blog's own measured / roofline for workload ``w``, converted to the roofline's unit where known
    (decode-only output: measured total * output / (input + output))."""
    p = w["published"]
    measured = p["measured_total_tok_s_chip"]
    if p["roofline_unit"].startswith("decode-only"):
        measured = measured * w["output"] / (w["input"] + w["output"])
    return measured / p["roofline"]


def implied_prompt_rate() -> dict[str, float]:
    """The prompt tok/s/chip the published measurements imply: the decode-heavy workload's measured time per
    decode step (its whole time over its output steps; its 1k-token prompts are a few percent of it, so
    this overstates the step a little) charged to the prefill-heavy workload's decode steps, the rest of its
    time taken to be prefill. Decode steps at the prefill-heavy workload's longer context are taken to cost
    the same. Returns ``{"decode_step_s", "prefill_s", "prompt_tok_s_chip"}``."""
    chips = BLOG_CONFIG["chips"]
    w1, w8 = WORKLOADS
    t1 = CONCURRENCY * (w1["input"] + w1["output"]) / (w1["published"]["measured_total_tok_s_chip"] * chips)
    step = t1 / w1["output"]
    t8 = CONCURRENCY * (w8["input"] + w8["output"]) / (w8["published"]["measured_total_tok_s_chip"] * chips)
    prefill = t8 - w8["output"] * step
    return {"decode_step_s": step, "prefill_s": prefill,
            "prompt_tok_s_chip": CONCURRENCY * w8["input"] / prefill / chips}


def calibrate(workloads: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured for each published workload (total tok/s/chip).

    ``workloads``: :func:`compose.compose_workloads`'s rows. Per workload: ``predicted`` (the plan: compiled
    bytes, slowest device under uniform routing, exposed collectives), ``roofline`` (minimum bytes, mean
    device, no collectives: the like-for-like of the blog's roofline), ``measured``, ``efficiency``
    (measured / predicted: what a real step achieves of the plan), ``blog_discount`` (the blog's measured /
    roofline) and ``discounted`` (our roofline times the blog's discount). Empty if there are no workloads.
    Also states how far the plan's configuration matches the blog's (``config_matches``), and sets the
    prompt rate and decode step time the measurements imply (:func:`implied_prompt_rate`) beside ours.
    """
    if not workloads:
        return {}
    mine = {"chips": report["chips"], "dp": report["dp"], "ep": report["ep"],
            "prefill_tokens_per_core": report["prefill_tokens_per_rank"], "fp8_weights": report["model"]["fp8"],
            "concurrency": CONCURRENCY}
    out: dict[str, Any] = {"blog_config": BLOG_CONFIG,
                           "config_matches": {k: mine[k] == BLOG_CONFIG[k] for k in mine}, "workloads": {},
                           "implied_by_measurements": implied_prompt_rate()}
    w8 = workloads[-1]
    out["prompt_tok_s_chip"] = {"roofline": w8["roofline"]["prompt_tok_s_chip"],
                                "planned": w8["planned"]["prompt_tok_s_chip"],
                                "implied_by_measurements": out["implied_by_measurements"]["prompt_tok_s_chip"]}
    out["decode_step_s"] = {"roofline": workloads[0]["roofline"]["decode_step_s"],
                            "planned": workloads[0]["planned"]["decode_step_s"],
                            "implied_by_measurements": out["implied_by_measurements"]["decode_step_s"]}
    for w in workloads:
        pub = next(p for p in WORKLOADS if p["name"] == w["name"])
        measured = pub["published"]["measured_total_tok_s_chip"]
        disc = blog_discount(pub)
        out["workloads"][w["name"]] = {
            "predicted": w["planned"]["total_tok_s_chip"], "roofline": w["roofline"]["total_tok_s_chip"],
            "measured": measured, "efficiency": measured / w["planned"]["total_tok_s_chip"],
            "blog_discount": disc, "discounted": w["roofline"]["total_tok_s_chip"] * disc,
            "predicted_zipf": w["planned_zipf"]["total_tok_s_chip"],
        }
    return out
