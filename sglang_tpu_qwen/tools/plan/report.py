"""Human-readable tables of the planner's report."""

from __future__ import annotations

from typing import Any

from sglang_tpu_qwen.tools.plan.calibration import CONCURRENCY


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
    """The report of :func:`build.plan` as text: memory, per-step bytes and times (mean vs slowest device,
    collectives), workloads in both units beside the published figures, and the calibration."""
    m = r["memory_per_device"]
    lines = [
        f"{r['topology']}: {r['devices']} devices on {r['chips']} chips, dp={r['dp']} ep={r['ep']} "
        f"combine={r['moe_combine']} fp8={r['model']['fp8']}, {r['max_running_requests']} running requests x "
        f"{r['context_length']} tokens; kernels {r['kernels']}",
        f"per device: weights {_gib(m['weights_replicated'] + m['weights_experts'])} "
        f"(replicated {_gib(m['weights_replicated'])}, experts {_gib(m['weights_experts'])}), "
        f"KV pool {_gib(m['kv_pool'])}, GDN slots {_gib(m['gdn_slots'])} ({m.get('gdn_running_slots', '?')} "
        f"running + {m.get('gdn_snapshot_slots', '?')} snapshots, rule: {m.get('split', {}).get('rule', '?')}), "
        f"HBM {_gib(m['hbm'])}; vision tower {m.get('vision_tower', 'not counted')}",
        "| step | bucket | args / temp / out per device | fits | HLO bytes | min bytes | ratio | roofline ms "
        "| HLO-bytes ms | serial ms | mean / slowest device ms (uniform; zipf) | collectives ms exposed / total (n) "
        "[fast..slow end] | planned ms | tok/s/chip (roofline / planned) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in r["steps"].items():
        if "error" in s:
            lines.append(f"| {name} | does not fit: {s['error']} |")
            continue
        mm, b, cl = s["memory"], s["bucket"], s["collective_s"]
        md = {k: v * 1e3 for k, v in s["mean_device_s"].items()}
        sd = {k: v * 1e3 for k, v in s["slowest_device_s"].items()}
        lines.append(
            f"| {name} | {b['batch']} x {s['new_tokens_per_row']} | {_gib(mm['arguments'])} / {_gib(mm['temp'])} / "
            f"{_gib(mm['output'])} | {mm['fits']} | {_gib(s['bytes_accessed'])} | {_gib(s['min_bytes'])} | "
            f"{s['bytes_ratio']:.2f} | {s['roofline_s'] * 1e3:.2f} ({s['roofline_bound']}) | "
            f"{s['compiled_time_s'] * 1e3:.2f} | {s['serial_s'] * 1e3:.2f} | "
            f"{md['uniform']:.2f} / {sd['uniform']:.2f}; {md['zipf']:.2f} / {sd['zipf']:.2f} | "
            f"{cl['exposed'] * 1e3:.2f} / {cl['total'] * 1e3:.2f} ({cl['count']}) "
            f"[{cl['exposed_low'] * 1e3:.2f}..{cl['exposed_high'] * 1e3:.2f}] | "
            f"{s['planned_s']['uniform'] * 1e3:.2f} | "
            f"{s['roofline_tokens_per_s_per_chip']:.0f} / {s['planned_tokens_per_s_per_chip']:.0f} |")
    for name, s in r["steps"].items():
        for kind, k in s.get("collective_s", {}).get("by_kind", {}).items():
            lines.append(f"{name} {kind}: x{k['count']:.0f}, {k['s_each'] * 1e6:.1f} us each, exposed "
                         f"{k['exposed_s'] * 1e3:.2f} ms of {k['count'] * k['s_each'] * 1e3:.2f}")
        for e in s.get("moe_extra", {}).values():
            if "analytic" not in e:
                continue
            a, mc = e["analytic"], e["monte_carlo"]
            lines.append(f"{name} {e['distribution']}: {e['tokens']} tokens, local experts touched mean "
                         f"{a['mean_experts']:.1f} / slowest {a['max_experts']:.1f} (Monte-Carlo "
                         f"{mc['mean_experts']:.1f} / {mc['max_experts']:.1f}; kernel declares "
                         f"{e['kernel_declared_experts']:.1f}), pairs mean {a['mean_pairs']:.0f} / slowest "
                         f"{a['max_pairs']:.0f}")
        for i, e in enumerate(s.get("top_excess", [])):
            lines.append(f"{name} excess #{i + 1}: {_gib(e['bytes'])} {e['opcode']} {e['op']} x{e['count']} "
                         f"({e['source']})")
    spec = r.get("speculative")
    if spec:
        v = r["steps"].get("verify", {})
        lines.append(f"speculative decoding (MTP, {spec['num_draft_tokens']} tokens a verify step, accept length "
                     f"{spec['accept_length']}): verify forward bytes / its minimum "
                     f"{v.get('forward_bytes_ratio', float('nan')):.2f}; MTP layer weights per device "
                     f"{_gib(spec['mtp_weights_replicated'] + spec['mtp_weights_experts'])}")
        for w in r.get("workloads_without_speculation", []):
            lines.append(f"workload {w['name']} x {CONCURRENCY} without speculation: planned total tok/s/chip "
                         f"{w['tok_s_chip']:.0f} (roofline {w['roofline']['total_tok_s_chip']:.0f})")
    for w in r.get("workloads", []):
        p, ro, pl, pz = w["published"], w["roofline"], w["planned"], w["planned_zipf"]
        fast, slow = w["planned_ici_fast"]["total_tok_s_chip"], w["planned_ici_slow"]["total_tok_s_chip"]
        lines.append(f"workload {w['name']} x {CONCURRENCY}"
                     f"{' with speculation' if spec else ''}: total tok/s/chip roofline {ro['total_tok_s_chip']:.0f}, "
                     f"planned {pl['total_tok_s_chip']:.0f} (zipf {pz['total_tok_s_chip']:.0f}; ICI fast .. slow end "
                     f"{fast:.0f} .. {slow:.0f}); published measured "
                     f"{p['measured_total_tok_s_chip']} | decode-only output tok/s/chip roofline "
                     f"{ro['decode_output_tok_s_chip']:.0f}, planned {pl['decode_output_tok_s_chip']:.0f}; published "
                     f"roofline {p['roofline']} ({p['roofline_unit']}: {p['roofline_definition']})")
    for name, cw in r.get("calibration", {}).get("workloads", {}).items():
        lines.append(f"calibration {name}: predicted {cw['predicted']:.0f}, measured {cw['measured']}, efficiency "
                     f"{cw['efficiency']:.3f}; blog discount {cw['blog_discount']:.3f} -> discounted roofline "
                     f"{cw['discounted']:.0f} (undiscounted {cw['roofline']:.0f})")
    cal = r.get("calibration", {})
    if cal:
        p, d = cal["prompt_tok_s_chip"], cal["decode_step_s"]
        lines.append(f"prompt tok/s/chip: roofline {p['roofline']:.0f}, planned {p['planned']:.0f}, implied by the "
                     f"measurements {p['implied_by_measurements']:.0f}; decode step (1k / 8k) roofline "
                     f"{d['roofline'] * 1e3:.2f} ms, planned {d['planned'] * 1e3:.2f} ms, implied "
                     f"{d['implied_by_measurements'] * 1e3:.2f} ms")
    lines.append(f"peaks: {r['chip']['source']}")
    return "\n".join(lines)
