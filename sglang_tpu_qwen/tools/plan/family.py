"""Plan every model of the catalog: the smallest Ironwood topology each fits on, and what limits its steps.

``python -m sglang_tpu_qwen.tools.plan.family [--models a,b] [--json out.json]``

For each named model (model/catalog.py) it tries the topologies of ``TOPOLOGIES`` from the smallest, with
dp = ep = every device of the topology (DP attention, EP MoE: the server's layout; a dense model has no
experts, so its weights are whole on every device), block-FP8 weights, ``CONCURRENCY`` running requests at
the planner's default context, and takes the first where both the decode and the prefill step fit in HBM.
The table it prints is the one in docs/performance.md ("The Qwen3.5 family on Ironwood").
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from sglang_tpu_qwen.model.catalog import MODEL_CONFIGS, model_config
from sglang_tpu_qwen.tools.plan.build import plan
from sglang_tpu_qwen.tools.plan.calibration import CONCURRENCY

# Ironwood slices from the smallest: libtpu's host bounds make 2x2x1 (4 chips, 8 TensorCores) the smallest.
TOPOLOGIES = ("tpu7x:2x2x1", "tpu7x:2x2x2", "tpu7x:2x2x4")
CONTEXT_LENGTH = 9216  # the planner's default: the 8k-in / 1k-out workload's full context


def plan_smallest(name: str) -> dict[str, Any]:
    """Plan ``name`` on the first topology of ``TOPOLOGIES`` where both steps fit.

    Returns:
        the planner's report (``build.plan``) with ``name`` added; ``fits`` False when even the largest
        topology does not hold it.

    Raises:
        KeyError: ``name`` is not in the catalog.
    """
    config = model_config(name)
    report: dict[str, Any] = {}
    for topology in TOPOLOGIES:
        devices = 2 * _chips(topology)
        report = plan(config, topology, devices, devices, CONCURRENCY, CONTEXT_LENGTH, fp8=True)
        report["name"] = name
        if report["fits"]:
            break
    return report


def _chips(topology: str) -> int:
    x, y, z = (int(v) for v in topology.split(":")[1].split("x"))
    return x * y * z


def _limit(step: dict[str, Any]) -> str:
    """The largest term of a step's planned time: the roofline's bound, the excess bytes, or collectives."""
    coll = step["collective_s"]["exposed"]
    roofline = step["roofline_s"]
    excess = step["planned_s"]["uniform"] - coll - roofline
    terms = {f"{step['roofline_bound']} roofline": roofline, "bytes over the minimum": excess,
             "exposed collectives": coll}
    return max(terms, key=lambda k: terms[k])


def table(reports: list[dict[str, Any]]) -> str:
    """Markdown rows: topology, weights, both steps' bytes ratios and planned times, both workloads."""
    head = ("| model | topology (dp = ep) | weights / device | decode: bytes ratio, planned ms, limit | "
            "prefill: bytes ratio, planned ms, limit | 1k/8k total tok/s/chip (decode-only output) | "
            "8k/1k total tok/s/chip |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in reports:
        if not r.get("fits"):
            lines.append(f"| {r['name']} | does not fit on {r['topology']} | | | | | |")
            continue
        m = r["memory_per_device"]
        cells = []
        for name in ("decode", "prefill"):
            s = r["steps"][name]
            cells.append(f"{s['bytes_ratio']:.2f}, {s['planned_s']['uniform'] * 1e3:.2f}, {_limit(s)}")
        w = {x["name"]: x["planned"] for x in r["workloads"]}
        w1, w8 = w.get("1k in / 8k out", {}), w.get("8k in / 1k out", {})
        lines.append(
            f"| {r['name']} | {r['topology']} ({r['dp']}) | "
            f"{(m['weights_replicated'] + m['weights_experts']) / 2**30:.2f} GiB | {cells[0]} | {cells[1]} | "
            f"{w1.get('total_tok_s_chip', float('nan')):,.0f} ({w1.get('decode_output_tok_s_chip', float('nan')):,.0f})"
            f" | {w8.get('total_tok_s_chip', float('nan')):,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Plan the models named by ``--models`` (default: the whole catalog) and print the table."""
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.tools.plan.family")
    ap.add_argument("--models", default=",".join(MODEL_CONFIGS), help="comma-separated catalog names")
    ap.add_argument("--json", help="also write the reports here")
    a = ap.parse_args(argv)
    reports = []
    for name in a.models.split(","):
        reports.append(plan_smallest(name))
        print(table(reports[-1:]).splitlines()[-1], flush=True)
    print(table(reports))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1)
    return reports


if __name__ == "__main__":
    main()
