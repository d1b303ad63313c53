"""Compose the compiled steps into the published serving workloads, in the published units.

A workload runs ``CONCURRENCY`` requests of ``input`` prompt tokens and ``output`` generated tokens:
- prefill: each DP rank prefills one chunk of ``prefill_tokens_per_rank`` tokens per step, so the prompts
  take ``ceil(CONCURRENCY * input / (dp * chunk))`` steps; chunk ``i`` of a prompt attends over a prefix of
  ``i * chunk`` earlier tokens (its attention flops, and its KV reads in the minimum bytes; the compiled
  attention kernel already declares a full-width KV read per row, an upper bound the HLO bytes keep);
- decode: ``output`` steps, each request one token, at the average context ``input + output / 2``: the
  compiled decode step's KV read and attention flops rescaled from its compiled context. Each DP rank holds
  ``CONCURRENCY / dp`` of the requests (its rows; a rank may span several devices).

Three figures per workload, each in two units, total (input + output) tok/s/chip and decode-only output
tok/s/chip (``CONCURRENCY`` tokens per decode step / step time / chips, the unit of the blog's 978):
- ``roofline``: minimum bytes vs flops, the mean device, no collectives (the blog's kind of roofline);
- ``planned``: the compiled step's instructions one after another, each at its own roofline (HLO bytes,
  declared kernel flops), the slowest device under uniform routing, and the collectives' exposed time;
- ``planned_zipf``: the same under the skewed routing (routing.py);
- ``planned_ici_fast`` / ``planned_ici_slow``: ``planned`` with the collectives at the fast / slow end of the
  chip model's assumed ranges (chips.py).
"""

from __future__ import annotations

import math
from typing import Any

from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.tools.plan.calibration import CONCURRENCY, WORKLOADS
from sglang_tpu_qwen.tools.plan.chips import ChipPeaks
from sglang_tpu_qwen.tools.plan.flops import attention_flops_per_token


def step_time(s: dict[str, Any], chip: ChipPeaks, *, kind: str, extra_bytes: float = 0.0,
              extra_flops: float = 0.0, ici_end: str = "central") -> float:
    """Seconds of one step. ``s``: a step of the report (``min_bytes``, ``flops``, ``serial_s``, ``moe_extra``
    and ``collective_s`` used); ``kind``: "roofline", "planned" (uniform routing) or "planned_zipf";
    ``extra_bytes`` / ``extra_flops``: what the step moves and computes beyond the compiled one (a longer or
    shorter context, a prefix); ``ici_end``: the collectives' exposed time at the chip model's "central",
    "low" (fast) or "high" (slow) end.

    roofline = max(minimum bytes / bandwidth, flops / peak) on the mean device, nothing else. planned = the
    compiled instructions one after another, each at its own roofline (``serial_s``), plus the extra bytes and
    flops (serially: at decode the extra is KV bytes, at a prefill chunk attention flops), plus what the
    slowest device's MoE layers add (its extra experts' bytes and pairs' flops), plus the collectives'
    exposed time."""
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    peak = chip.bf16_flops_per_s / chip.devices_per_chip
    if kind == "roofline":
        return max((s["min_bytes"] + extra_bytes) / bw, (s["flops"] + extra_flops) / peak)
    moe = s["moe_extra"]["zipf" if kind == "planned_zipf" else "uniform"]
    t = s["serial_s"] + extra_bytes / bw + extra_flops / peak
    exposed = s["collective_s"]["exposed" if ici_end == "central" else f"exposed_{ici_end}"]
    return t + moe["slowest_bytes"] / bw + moe["slowest_flops"] / peak + exposed


def _units(tokens: int, t_total: float, t_dec: float, chips: int) -> dict[str, float]:
    return {"total_tok_s_chip": tokens / t_total / chips, "decode_output_tok_s_chip": CONCURRENCY / t_dec / chips}


def compose_workloads(report: dict[str, Any], chip: ChipPeaks, config: Qwen35MoeConfig,
                      kv_per_token: int, *, decode_step: str = "decode",
                      tokens_per_step: float = 1.0) -> list[dict[str, Any]]:
    """Each of ``WORKLOADS`` at ``CONCURRENCY`` requests from the report's decode and prefill steps (module
    docstring). ``kv_per_token``: KV bytes of one token over all attention layers. Empty unless the plan's
    steps are at ``CONCURRENCY`` running requests (a decode step of another batch size would charge the
    workload's requests for rows they do not have).

    ``decode_step``: the step that generates ("verify": speculative decoding's verify + commit + draft step,
    feeding ``new_tokens_per_row`` tokens a row), yielding ``tokens_per_step`` output tokens a request (the
    accept length), so the output takes ``output / tokens_per_step`` such steps; its attention reads the
    context once a step and computes it for each fed token. Each row also carries ``tok_s_chip``: the planned
    total tok/s/chip."""
    dec, pre = report["steps"].get(decode_step), report["steps"].get("prefill")
    if not dec or not pre or "error" in dec or "error" in pre or report["max_running_requests"] != CONCURRENCY:
        return []
    dp, chips, chunk = report["dp"], report["chips"], report["prefill_tokens_per_rank"]
    rows_rank = CONCURRENCY / dp  # requests per DP rank: the rows each rank's devices read KV and compute for
    out = []
    for w in WORKLOADS:
        ctx = w["input"] + w["output"] / 2
        kv_delta = rows_rank * (ctx - dec["context"]) * kv_per_token
        flops_delta = rows_rank * dec["new_tokens_per_row"] * (attention_flops_per_token(config, ctx)
                                                               - attention_flops_per_token(config, dec["context"]))
        decode_steps = w["output"] / tokens_per_step
        prefill_steps = math.ceil(CONCURRENCY * w["input"] / (dp * chunk))
        prefixes = [i * chunk for i in range(math.ceil(w["input"] / chunk))]
        row = {"name": w["name"], "input": w["input"], "output": w["output"], "concurrency": CONCURRENCY,
               "prefill_steps": prefill_steps, "decode_steps": decode_steps, "decode_step": decode_step,
               "tokens_per_decode_step": tokens_per_step, "chunk_prefixes": prefixes,
               "published": w["published"]}
        tokens = CONCURRENCY * (w["input"] + w["output"])
        for kind, end in (("roofline", "central"), ("planned", "central"), ("planned_zipf", "central"),
                          ("planned_ici_fast", "low"), ("planned_ici_slow", "high")):
            k = kind if kind in ("roofline", "planned_zipf") else "planned"
            t_dec = step_time(dec, chip, kind=k, extra_bytes=kv_delta, extra_flops=flops_delta, ici_end=end)
            t_pre = sum(step_time(pre, chip, kind=k, extra_bytes=p * kv_per_token if k == "roofline" else 0.0,
                                  extra_flops=chunk * attention_flops_per_token(config, p), ici_end=end)
                        for p in prefixes)
            t_pre /= len(prefixes)
            t_total = prefill_steps * t_pre + decode_steps * t_dec
            row[kind] = {**_units(tokens, t_total, t_dec / tokens_per_step, chips), "decode_step_s": t_dec,
                         "prefill_step_s": t_pre, "prompt_tok_s_chip": dp * chunk / t_pre / chips}
        row["tok_s_chip"] = row["planned"]["total_tok_s_chip"]
        out.append(row)
    return out
