"""Decode step against its HBM roofline and the planner's plan: device time, bytes by part, and a profile.

``python -m sglang_tpu_qwen.bench.decode_step [--model-path P] [--rows 8,64,256] [--context 576] [--profile DIR]``
(issue 42, "The step" and "The planner learns the chip we can measure").

One in-process ``Engine`` (no sockets; one process holds the chip) with the server's default flags, except
``--max-running-requests``, which defaults to the largest ``--rows`` (every server flag is accepted, SGLang's
names). Model: ``shaped-35b`` (the default: the random checkpoint shaped like Qwen3.5-35B-A3B, built on first use
by ``python -m sglang_tpu_qwen.embedded.shaped_35b`` in a subprocess of its own), ``embedded`` (the embedded tiny
model) or a checkpoint directory. For each row count it prints:

- ``device ms``: one greedy decode step (forward, sampling and keep-sampled programs) of the rows' decode bucket,
  every row at ``--context`` tokens, replayed back to back on the idle engine (bench/decode_timer.py
  ``time_decode_step``: the median of ``--windows`` windows of ``--iters`` steps); the compilations during the
  replay are counted (engine/runner/compilation.py) and must be 0;
- the step's least HBM bytes by part, from the planner's own account (tools/plan/step_bytes.py, what
  ``tools.plan`` holds a compiled step against): the lm_head, the experts that ``rows x top_k`` uniform routings
  touch (``E * (1 - (1 - k / E) ** rows)`` of ``E`` per MoE layer), the other weights (shared expert, attention,
  GDN and dense projections, routers, norms), the GDN recurrent and conv states read and written at their stored
  dtype, the KV read at the context (and the new token's written), the embedding rows;
- ``roofline ms``: those bytes at the chip's HBM peak (tools/plan/chips.py, the chip JAX reports; a v5e off a
  TPU, where the ratios say nothing about a chip), and ``roofline / measured``;
- ``planned ms``: the planner's decode step for the same chip, rows, context, page size and cache dtypes
  (``tools.plan.plan`` on a deviceless one-chip topology after the engine is shut down: the server's decode and
  greedy sampling programs compiled for the chip, each instruction at its own roofline, HLO bytes at the HBM peak
  and declared kernel flops at the bf16 peak, summed one after another, the MoE layers' slowest device under
  uniform routing; one chip has no collectives), and ``planned / measured``.

``--profile DIR`` captures ``jax.profiler.trace`` over ``--profile-steps`` replayed decode steps at
``--profile-rows`` rows and prints the device time per step by category (the Pallas attention, GDN and FP8
kernels, the MoE grouped matmuls and routing, the lm_head, sampling, copies, the XLA parts of attention and GDN,
the rest) and the 15 largest ops. Ops are named by the step's compiled programs (their op_name metadata carries
the model's named scopes, model/forward.py; ``--profile`` keys the persistent compilation cache by that metadata, so
the first such run compiles cold). Off a TPU the trace has no device plane: it says so and groups
the host plane's XLA ops instead (summed over the threads that run them: shares, not a step time).

Prints a Markdown table and one JSON line (``--output-json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

logger = logging.getLogger("sglang_tpu_qwen.bench.decode_step")

EMBEDDED = "embedded"
DEFAULT_ROWS = (8, 64, 256)
# 64 requests of 512 prompt tokens generating 128: the mean context over their decode steps is 512 + 128 / 2.
DEFAULT_CONTEXT = 576
# The deviceless topology of one chip of each family the planner plans beside a measurement.
ONE_CHIP_TOPOLOGY = {"v5e": "v5e:1x1"}
TOP_OPS = 15


# ---- the roofline ---------------------------------------------------------------------------------------------
def roofline_parts(runner: Any, rows: int, context: int) -> tuple[Any, dict[str, float]]:
    """The decode bucket of ``rows`` rows (per DP rank) and the least bytes one device moves in one decode step of
    that bucket at ``context`` tokens a row, by part (tools/plan/step_bytes.py: the planner's account). The bucket
    pads ``rows`` up to a compiled batch size; every padded row is a real row in the replayed step."""
    from sglang_tpu_qwen.tools.plan import step_bytes

    dp = runner.sizing.dp
    bucket = runner.buckets.decode_bucket(-(-rows // dp))
    ep = runner.layout.ep if runner.layout is not None else 1
    rb = step_bytes.runner_bytes(runner, ep)
    parts = step_bytes.step_min_bytes(rb, "decode", rows_rank=bucket.batch // dp, tokens=1, prefix=context - 1,
                                      tokens_step=bucket.batch)
    return bucket, parts


def experts_touched(runner: Any, tokens: int) -> tuple[float, int]:
    """(experts per MoE layer that ``tokens`` tokens' uniform routings touch, expected; local experts)."""
    from sglang_tpu_qwen.tools.plan import step_bytes

    ep = runner.layout.ep if runner.layout is not None else 1
    rb = step_bytes.runner_bytes(runner, ep)
    return rb.experts_touched(tokens), rb.local_experts


def chip_for(device_kind: str) -> tuple[str, bool]:
    """(key of tools/plan/chips.py CHIPS for JAX's ``device_kind``, whether it is that chip): an unknown device (a
    CPU) gets the v5e's figures, flagged."""
    from sglang_tpu_qwen.tools.plan.chips import DEVICE_KINDS

    key = DEVICE_KINDS.get(device_kind)
    return (key, True) if key is not None else ("v5e", False)


# ---- measuring ------------------------------------------------------------------------------------------------
def measure_rows(engine: Any, rows: int, context: int, chip_key: str, *, iters: int, windows: int) -> dict[str, Any]:
    """One row count on an idle ``engine``: the replayed step's device time, its compilations and its roofline."""
    from sglang_tpu_qwen.bench.decode_timer import time_decode_step
    from sglang_tpu_qwen.engine.runner import compilation
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    runner = engine.runner
    bucket, parts = roofline_parts(runner, rows, context)
    limit = bucket.pages * runner.sizing.page_size
    if context > limit:
        raise ValueError(f"--context {context} exceeds the decode bucket's page table ({bucket.pages} pages x "
                         f"{runner.sizing.page_size} = {limit} tokens): raise --context-length")
    compiles = compilation.jit_compilations()
    replay = time_decode_step(runner, bucket.batch, context, iters=iters, windows=windows)
    device_s = replay.step_s
    compiles = compilation.jit_compilations() - compiles
    chip = CHIPS[chip_key]
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    total = sum(parts.values())
    touched, local = experts_touched(runner, bucket.batch)
    return {"rows": rows, "bucket_rows": bucket.batch, "context": context, "device_s": device_s,
            "dispatch_s": replay.dispatch_s,
            "compilations": compiles, "bytes": parts, "bytes_total": total, "roofline_s": total / bw,
            "roofline_over_measured": total / bw / device_s, "experts_touched": touched, "local_experts": local}


def plan_rows(engine_info: dict[str, Any], config: Any, chip_key: str, rows: int, context: int) -> dict[str, Any]:
    """The planner's decode step of ``rows`` rows at ``context`` on one chip ``chip_key`` with the engine's page size
    and cache dtypes (``tools.plan.plan``; compiles for a deviceless topology: run it with no engine serving).
    Returns ``planned_s`` (uniform routing), ``roofline_s``, ``min_bytes`` and its parts, ``bytes_ratio``."""
    from sglang_tpu_qwen.tools.plan import plan

    report = plan(config, ONE_CHIP_TOPOLOGY[chip_key], 1, 1, rows, context, page_size=engine_info["page_size"],
                  steps=("decode",), kv_cache_dtype=engine_info["kv_cache_dtype"],
                  mamba_ssm_dtype=engine_info["mamba_ssm_dtype"])
    step = report["steps"]["decode"]
    if "error" in step:
        return {"error": step["error"]}
    return {"planned_s": step["planned_s"]["uniform"], "roofline_s": step["roofline_s"],
            "min_bytes": step["min_bytes"], "min_bytes_parts": step["min_bytes_parts"],
            "bytes_ratio": step["bytes_ratio"], "serial_s": step["serial_s"], "bucket_rows": step["rows"],
            "kernels": report["kernels"], "top_excess": step["top_excess"][:3]}


# ---- the profile ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One top-level instruction of a compiled program: its opcode and op_name metadata."""

    opcode: str
    op_name: str


def op_table(programs: list[tuple[str, str]]) -> dict[str, dict[str, OpInfo]]:
    """``{module name: {instruction name: OpInfo}}`` of compiled HLO texts (``(label, hlo_text)`` pairs; the module
    name is the text's ``HloModule`` line's, e.g. ``jit_forward_program``), top-level instructions only
    (tools/hlo_traffic.py: what a profile's op events are)."""
    from sglang_tpu_qwen.tools import hlo_traffic

    out: dict[str, dict[str, OpInfo]] = {}
    for _, text in programs:
        m = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
        module = m.group(1) if m else ""
        table = out.setdefault(module, {})
        for op in hlo_traffic.program_traffic(text):
            table[op.name] = OpInfo(op.opcode, op.op_name)
    return out


def profiled_programs(runner: Any, rows: int) -> list[tuple[str, str]]:
    """``(label, compiled HLO text)`` of the programs one replayed decode step of ``rows`` rows runs (the decode
    forward of its bucket, greedy sampling, keep-sampled): the runner's own executables, whose instruction names the
    trace's ops carry. Their op_name metadata is that of the code that compiled them: JAX's persistent cache keys
    leave metadata out unless ``jax_compilation_cache_include_metadata_in_key`` is on (``--profile`` turns it on
    before the engine starts), so a program loaded from an older entry may lack the model's named scopes."""
    bucket = runner.buckets.decode_bucket(-(-rows // runner.sizing.dp))
    keys = [("forward", bucket), ("sample", "greedy", bucket.batch), ("keep_sampled", bucket.batch)]
    return [(str(key), runner.programs.get(key).as_text()) for key in keys]


# (category, test): the first whose test holds names an op. ``t``: the op's lower-cased text (name, opcode, op_name
# metadata, the trace's own strings); ``op``: its opcode ("" when unknown); ``module``: its program.
_KERNEL_OPS = ("custom-call", "tpu_custom_call")


def _kernel(t: str, op: str) -> bool:
    """A Mosaic kernel call: by its opcode, or by its instruction text where the opcode is unknown."""
    return op in _KERNEL_OPS or "tpu_custom_call" in t


CATEGORIES: tuple[tuple[str, Any], ...] = (
    ("attention kernel (Pallas)", lambda t, op, module: _kernel(t, op) and "ragged_paged_attention" in t),
    ("GDN kernel (Pallas)", lambda t, op, module: _kernel(t, op) and "fused_gdn" in t),
    ("MoE grouped matmul (ragged_dot / FP8 kernel)",
     lambda t, op, module: any(k in t for k in ("ragged-dot", "ragged_dot", "fp8_matmul", "grouped_matmul"))),
    ("copies", lambda t, op, module: op in ("copy", "copy-start", "copy-done") or t.startswith("copy")),
    ("MoE routing (top-k, sort, gather / scatter)",
     lambda t, op, module: "/moe/" in t and any(k in t for k in ("top_k", "sort", "gather", "scatter", "select_n",
                                                                  "clip", "floor_divide"))),
    ("MoE router, shared expert, combine", lambda t, op, module: "/moe/" in t),
    ("lm_head", lambda t, op, module: "lm_head" in t),
    ("sampling", lambda t, op, module: "sample" in module),
    ("attention (XLA: projections, RoPE, norms, KV write)", lambda t, op, module: "/attention/" in t),
    ("GDN (XLA: projections, gates, state layout)", lambda t, op, module: "/gdn/" in t),
    ("dense MLP", lambda t, op, module: "/mlp/" in t),
)
OTHER = "other (norms, residuals, embedding, control)"


def categorize(name: str, opcode: str, op_name: str, module: str, extra: str = "") -> str:
    """The category of one op (see CATEGORIES), else OTHER."""
    t = " ".join((name, opcode, op_name, extra)).lower()
    for label, test in CATEGORIES:
        if test(t, opcode, module.lower()):
            return label
    return OTHER


def _module_name(name: str) -> str:
    """``jit_forward_program(12)`` / ``%jit_forward_program`` -> ``jit_forward_program``."""
    return re.sub(r"\(.*$", "", name.strip().lstrip("%"))


def _self_times(events: list[Any]) -> list[tuple[Any, float]]:
    """(event, its duration less that of the events nested in it on the same line), in start order: a control-flow
    op that encloses its body's ops is not counted twice."""
    evs = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    out: list[list[Any]] = []
    stack: list[list[Any]] = []  # [event, self time, end]
    for e in evs:
        while stack and e.start_ns >= stack[-1][2]:
            stack.pop()
        entry = [e, float(e.duration_ns), e.start_ns + e.duration_ns]
        if stack:
            stack[-1][1] -= e.duration_ns
        stack.append(entry)
        out.append(entry)
    return [(e, max(0.0, s)) for e, s, _ in out]


def _stats(e: Any) -> dict[str, Any]:
    try:
        return {str(k): v for k, v in e.stats}
    except Exception:  # a trace without stats on its events
        return {}


def aggregate_profile(profile: Any, table: dict[str, dict[str, OpInfo]], steps: int) -> dict[str, Any]:
    """Per-category and per-op time of a trace (``jax.profiler.ProfileData``) over ``steps`` replayed steps.

    Device planes (``/device:...``) with an ``XLA Ops`` line are used when present: each op's self time (nested
    ops taken out), its program from its ``hlo_module`` stat or the ``XLA Modules`` event enclosing it, its opcode
    and op_name from ``table`` (:func:`op_table`; else the event's own strings). Without one (a CPU backend), the
    host plane's events that carry an ``hlo_op`` stat (XLA:CPU's ops, on several threads at once).

    Returns ``{"source": "device" | "host" | "none", "plane", "steps", "total_ms_per_step", "modules_ms_per_step",
    "categories": [{"category", "ms_per_step", "share"}], "top_ops": [{"op", "module", "category", "opcode",
    "op_name", "ms_per_step", "share", "count"}]}`` (shares of the total; time in ms per step).
    """
    steps = max(1, steps)
    planes = list(profile.planes)
    device = [p for p in planes if p.name.startswith("/device:") and any(ln.name == "XLA Ops" for ln in p.lines)]
    rows: list[tuple[str, str, float]] = []  # (op, module, self ns)
    extras: dict[tuple[str, str], str] = {}
    source, plane_name, modules_ns = "none", "", 0.0
    if device:
        plane = sorted(device, key=lambda p: p.name)[0]
        source, plane_name = "device", plane.name
        mod_events = sorted((e for ln in plane.lines if ln.name == "XLA Modules" for e in ln.events),
                            key=lambda e: e.start_ns)
        modules_ns = float(sum(e.duration_ns for e in mod_events))
        starts = [e.start_ns for e in mod_events]
        for ln in plane.lines:
            if ln.name != "XLA Ops":
                continue
            for e, self_ns in _self_times(list(ln.events)):
                st = _stats(e)
                module = str(st.get("hlo_module", ""))
                if not module and mod_events:
                    i = bisect.bisect_right(starts, e.start_ns) - 1
                    if i >= 0 and e.start_ns < mod_events[i].start_ns + mod_events[i].duration_ns:
                        module = mod_events[i].name
                name = str(st.get("hlo_op", "")) or e.name
                key = (name.lstrip("%"), _module_name(module))
                rows.append((*key, self_ns))
                extras.setdefault(key, " ".join(str(v) for v in st.values() if isinstance(v, str)))
    else:
        for plane in (p for p in planes if p.name.startswith("/host:")):
            found = len(rows)
            for ln in plane.lines:
                ops = [e for e in ln.events if "hlo_op" in _stats(e)]
                for e, self_ns in _self_times(ops):
                    st = _stats(e)
                    rows.append((str(st["hlo_op"]), _module_name(str(st.get("hlo_module", ""))), self_ns))
            if len(rows) > found:
                source, plane_name = "host", plane.name
    per_op: dict[tuple[str, str], list[float]] = {}
    for name, module, ns in rows:
        acc = per_op.setdefault((name, module), [0.0, 0])
        acc[0] += ns
        acc[1] += 1
    total_ns = sum(v[0] for v in per_op.values())
    cats: dict[str, float] = {}
    ops = []
    for (name, module), (ns, count) in per_op.items():
        # On the v5e the device plane's op is the whole instruction text ("fused_gdn.2 = (...) custom-call(...)"):
        # its name is what comes before " = ".
        short = name.split(" = ", 1)[0].strip().lstrip("%")
        info = table.get(module, {}).get(short)
        if info is None:  # a module name that differs from the HLO's: the op's name alone
            info = next((t[short] for t in table.values() if short in t), None)
        opcode, op_name = (info.opcode, info.op_name) if info else ("", "")
        cat = categorize(name, opcode, op_name, module, extras.get((name, module), ""))
        cats[cat] = cats.get(cat, 0.0) + ns
        ops.append({"op": short, "module": module, "category": cat, "opcode": opcode, "op_name": op_name[-100:],
                    "ms_per_step": ns / 1e6 / steps, "share": ns / total_ns if total_ns else 0.0,
                    "count": count / steps})
    ops.sort(key=lambda o: -o["ms_per_step"])
    categories = [{"category": c, "ms_per_step": ns / 1e6 / steps, "share": ns / total_ns if total_ns else 0.0}
                  for c, ns in sorted(cats.items(), key=lambda kv: -kv[1])]
    return {"source": source, "plane": plane_name, "steps": steps, "total_ms_per_step": total_ns / 1e6 / steps,
            "modules_ms_per_step": modules_ns / 1e6 / steps if modules_ns else None, "categories": categories,
            "top_ops": ops[:TOP_OPS], "ops": ops}


def capture_profile(runner: Any, rows: int, context: int, steps: int, out_dir: str | Path) -> Path:
    """``jax.profiler.trace`` into ``out_dir`` over ``steps`` decode steps of ``rows`` rows at ``context``, replayed
    on the idle runner after two untimed ones (bench/decode_timer.py); returns the trace's ``.xplane.pb``.

    Raises:
        FileNotFoundError: the profiler wrote no trace."""
    import jax

    from sglang_tpu_qwen.bench.decode_timer import time_decode_step

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    time_decode_step(runner, rows, context, iters=1, windows=1)  # warm: the traced steps compile nothing
    start = time.time()
    with jax.profiler.trace(str(out)):
        time_decode_step(runner, rows, context, iters=steps, windows=1, warmup=0)
    found = [p for p in out.rglob("*.xplane.pb") if p.stat().st_mtime >= start - 1]
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {out} after the trace")
    return max(found, key=lambda p: p.stat().st_mtime)


def profile_step(runner: Any, rows: int, context: int, steps: int, out_dir: str | Path) -> dict[str, Any]:
    """Capture (:func:`capture_profile`) and aggregate (:func:`aggregate_profile`) ``steps`` decode steps; adds
    ``trace`` (the file) and ``rows`` / ``context``."""
    from jax.profiler import ProfileData

    bucket = runner.buckets.decode_bucket(-(-rows // runner.sizing.dp))
    path = capture_profile(runner, bucket.batch, context, steps, out_dir)
    table = op_table(profiled_programs(runner, bucket.batch))
    result = aggregate_profile(ProfileData.from_file(str(path)), table, steps)
    return {**result, "trace": str(path), "rows": bucket.batch, "context": context}


# ---- output ---------------------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def format_table(result: dict[str, Any]) -> str:
    """The result as Markdown: the setup, one row per row count, then the profile (if any)."""
    chip, eng = result["chip"], result["engine"]
    lines = [
        f"Decode step: {result['model']} on {result['device_kind']} ({result['platform']}), JAX {result['jax']}; "
        f"engine: max running {eng['max_running_requests']}, context length {eng['context_length']}, page "
        f"{eng['page_size']}, compute {eng['dtype']}, KV {eng['kv_dtype']}, GDN state {eng['mamba_ssm_dtype']}, "
        f"kernels {eng['kernels']}; ready in {eng['ready_s']:.1f} s",
        f"Roofline: the step's least bytes (tools/plan/step_bytes.py) at {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s "
        f"({chip['name']}{'' if result['on_chip'] else ', NOT this device: the ratios are no chip figures'}); "
        f"device time: the replayed step (forward + greedy sampling + keep-sampled), median of "
        f"{result['windows']} x {result['iters']} steps, every row at {result['context']} tokens; host dispatch: "
        "the host's time to dispatch one step (near the device time: the host sets the pace).",
        "",
        "| rows (bucket) | device ms / step | host dispatch ms / step | lm_head GB | "
        "experts GB (touched / E per layer) | other weights GB | "
        "GDN recurrent GB | GDN conv GB | KV read + write GB | embedding rows GB | total GB | roofline ms | "
        "roofline / measured | planned ms | planned / measured | compilations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b = r["bytes"]
        p = r.get("plan") or {}
        planned = (f"{p['planned_s'] * 1e3:.2f}", f"{p['planned_s'] / r['device_s']:.2f}") if "planned_s" in p \
            else ("n/a", "n/a")
        lines.append(
            f"| {r['rows']} ({r['bucket_rows']}) | {r['device_s'] * 1e3:.2f} | {r['dispatch_s'] * 1e3:.2f} | "
            f"{_gb(b['lm_head'])} | "
            f"{_gb(b['experts'])} ({r['experts_touched']:.1f} / {r['local_experts']}) | {_gb(b['dense'])} | "
            f"{_gb(b['gdn_recurrent'])} | {_gb(b['gdn_conv'])} | {_gb(b['kv_read'] + b['kv_write'])} | "
            f"{_gb(b['embedding_rows'])} | {_gb(r['bytes_total'])} | {r['roofline_s'] * 1e3:.2f} | "
            f"{r['roofline_over_measured']:.2f} | {planned[0]} | {planned[1]} | {r['compilations']} |")
    plans = [r for r in result["rows"] if r.get("plan")]
    if plans:
        lines.append("")
        lines.append(f"Plan ({result['plan_topology']}, tools.plan): planned = the compiled decode and greedy "
                     "sampling programs' instructions one after another, each at its own roofline (HLO bytes at the "
                     "HBM peak, declared kernel flops at the bf16 peak), MoE at the slowest device under uniform "
                     "routing, no collectives on one chip; seconds per step.")
        for r in plans:
            p = r["plan"]
            if "error" in p:
                lines.append(f"- {r['rows']} rows: the planner failed: {p['error']}")
                continue
            same = abs(p["min_bytes"] - r["bytes_total"]) <= 1e-6 * r["bytes_total"]
            lines.append(f"- {r['rows']} rows: planned {p['planned_s'] * 1e3:.2f} ms (its roofline "
                         f"{p['roofline_s'] * 1e3:.2f} ms; least bytes {_gb(p['min_bytes'])} GB, "
                         f"{'the same as the table' if same else 'NOT the table: ' + _gb(r['bytes_total']) + ' GB'}; "
                         f"HLO bytes / least bytes {p['bytes_ratio']:.2f})")
    if result.get("plan_skipped"):
        lines += ["", f"Plan: skipped ({result['plan_skipped']})"]
    for prof in result.get("profiles", []):
        lines += ["", format_profile(prof)]
    return "\n".join(lines)


def format_profile(prof: dict[str, Any]) -> str:
    """The profile as Markdown: where its ops came from, the categories and the top ops."""
    if "error" in prof:
        return f"Profile at {prof['rows']} rows: failed: {prof['error']}"
    head = f"Profile of {prof['steps']} decode steps at {prof['rows']} rows x {prof['context']} ({prof['trace']}): "
    if prof["source"] == "device":
        head += (f"device plane {prof['plane']}, XLA ops {prof['total_ms_per_step']:.2f} ms per step (self time)"
                 + (f", XLA modules {prof['modules_ms_per_step']:.2f} ms" if prof.get("modules_ms_per_step") else ""))
    elif prof["source"] == "host":
        head += (f"no device plane in the trace (not a TPU): the host plane's XLA ops ({prof['plane']}), "
                 f"{prof['total_ms_per_step']:.2f} ms per step summed over the threads that ran them (they run in "
                 "parallel: shares, not a step time)")
    else:
        return head + "no device plane and no XLA ops on the host plane: nothing to break down"
    lines = [head, "", "| category | ms / step | share |", "|---|---|---|"]
    lines += [f"| {c['category']} | {c['ms_per_step']:.3f} | {100 * c['share']:.1f}% |" for c in prof["categories"]]
    lines += ["", f"| top {TOP_OPS} ops | program | category | ms / step | share | runs / step | op_name |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {o['op']} | {o['module']} | {o['category']} | {o['ms_per_step']:.3f} | {100 * o['share']:.1f}% | "
              f"{o['count']:g} | {o['op_name'] or o['opcode']} |" for o in prof["top_ops"]]
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ServerArgs]:
    """The benchmark's flags and the server's (ServerArgs, SGLang names). Exits with status 2 on a bad flag."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench.decode_step",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)),
                       help="Comma-separated decode row counts (each padded to its compiled bucket).")
    bench.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                       help="Tokens each row attends over (default 576: 512 in, 128 out, the mean decode context).")
    bench.add_argument("--iters", type=int, default=20, help="Replayed steps per timing window.")
    bench.add_argument("--windows", type=int, default=3, help="Timing windows (the median is reported).")
    bench.add_argument("--profile", default=None, metavar="DIR",
                       help="Capture a jax.profiler trace of replayed decode steps into DIR and break it down.")
    bench.add_argument("--profile-rows", default="64", help="Comma-separated row counts of the profiled steps.")
    bench.add_argument("--profile-steps", type=int, default=5, help="Decode steps inside the trace.")
    bench.add_argument("--no-plan", action="store_true", help="Skip the planner's step (a deviceless compile).")
    bench.add_argument("--output-json", default=None, help="Also write the result JSON to this path.")
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    try:
        ns.row_counts = sorted({int(x) for x in ns.rows.split(",") if x.strip()})
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {ns.rows!r}")
    try:
        ns.profile_row_counts = sorted({int(x) for x in ns.profile_rows.split(",") if x.strip()})
    except ValueError:
        p.error(f"--profile-rows takes comma-separated integers, got {ns.profile_rows!r}")
    if not ns.row_counts or ns.row_counts[0] <= 0 or ns.context <= 1 or ns.iters <= 0 or ns.windows <= 0 \
            or not ns.profile_row_counts or ns.profile_row_counts[0] <= 0 or ns.profile_steps <= 0:
        p.error("--rows, --iters, --windows, --profile-rows and --profile-steps must be positive, --context > 1")
    given = sys.argv[1:] if argv is None else argv
    if not any(a.startswith("--max-running-requests") for a in given):
        ns.max_running_requests = max(ns.row_counts + (ns.profile_row_counts if ns.profile else []))
    if ns.model_path is None:
        from sglang_tpu_qwen.bench.startup import SHAPED_35B

        ns.model_path = SHAPED_35B
    elif ns.model_path == EMBEDDED:
        ns.model_path = None
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        p.error(str(e))
    return ns, server_args


def run(ns: argparse.Namespace, server_args: ServerArgs) -> dict[str, Any]:
    """Start the engine, measure every row count (and the profile), shut it down, then plan; returns the result
    dict (its keys: the table's, see :func:`format_table`)."""
    import jax

    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    if ns.profile:
        # The profile names ops by their op_name metadata (the model's named scopes): key the persistent cache by it,
        # so that no program comes from an entry another version of the code wrote (a cold start the first time).
        jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    start = time.perf_counter()
    engine = Engine(server_args)
    ready_s = time.perf_counter() - start
    device = jax.devices()[0]
    chip_key, on_chip = chip_for(device.device_kind)
    runner = engine.runner
    args = engine.server_args
    if engine.grammar is not None:  # its background load (seconds of CPU) must not overlap the timed steps
        with contextlib.suppress(Exception):  # a failed load only matters to constrained requests
            engine.grammar.backend()
    engine_info = {"max_running_requests": args.max_running_requests, "context_length": engine.context_length,
                   "page_size": runner.sizing.page_size, "kv_dtype": runner.kv_dtype.name,
                   "kv_cache_dtype": args.kv_cache_dtype, "mamba_ssm_dtype": runner.sizing.state_dtype.name,
                   "dtype": runner.dtype.name, "dp": runner.sizing.dp, "ready_s": ready_s,
                   "kernels": {"attention": runner.backends.attention.name, "gdn": runner.backends.gdn.name},
                   "precompile": engine.precompile_stats}
    result: dict[str, Any] = {
        "model": Path(engine.model_path).name, "model_path": engine.model_path, "platform": device.platform,
        "device_kind": device.device_kind, "jax": jax.__version__, "chip": dataclasses.asdict(CHIPS[chip_key]),
        "chip_key": chip_key, "on_chip": on_chip, "context": ns.context, "iters": ns.iters,
        "windows": ns.windows, "engine": engine_info, "rows": []}
    config = runner.config
    try:
        for rows in ns.row_counts:
            r = measure_rows(engine, rows, ns.context, chip_key, iters=ns.iters, windows=ns.windows)
            logger.info("%d rows: %.3f ms per step, roofline %.3f ms", rows, r["device_s"] * 1e3,
                        r["roofline_s"] * 1e3)
            result["rows"].append(r)
        if ns.profile:
            result["profiles"] = []
            for rows in ns.profile_row_counts:
                try:
                    prof = profile_step(runner, rows, ns.context, ns.profile_steps, Path(ns.profile) / f"rows{rows}")
                except Exception as e:  # the measurements above stand without it
                    logger.exception("profile failed")
                    prof = {"error": f"{type(e).__name__}: {e}", "rows": rows}
                result["profiles"].append(prof)
    finally:
        engine.shutdown()
    _plan_all(ns, result, engine_info, config, chip_key)
    return result


def _plan_all(ns: argparse.Namespace, result: dict[str, Any], engine_info: dict[str, Any], config: Any,
              chip_key: str) -> None:
    """The planner's step beside each measured row count (skipped, with the reason, where it cannot run)."""
    if ns.no_plan:
        result["plan_skipped"] = "--no-plan"
        return
    if chip_key not in ONE_CHIP_TOPOLOGY or engine_info["dp"] != 1:
        result["plan_skipped"] = f"no one-chip topology for {chip_key} with dp {engine_info['dp']}"
        return
    result["plan_topology"] = ONE_CHIP_TOPOLOGY[chip_key]
    if result["platform"] != "tpu":
        # Off a TPU the deviceless compile loads libtpu beside other processes that may hold its lockfile (the
        # tests and tools do the same); on a TPU this process loaded it already.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from concurrent.futures import ThreadPoolExecutor

    from sglang_tpu_qwen.engine.runner import compilation

    def one(r: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            r["plan"] = plan_rows(engine_info, config, chip_key, r["bucket_rows"], r["context"])
        except Exception as e:  # no libtpu, or a topology it does not know: the measurements stand
            logger.exception("the planner failed")
            r["plan"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        r["plan_compile_s"] = time.perf_counter() - start

    # The row counts' compiles run side by side (XLA compiles without the GIL); the persistent cache stays off
    # around all of them (plan() turns it off around its own compiles: one thread must not turn it back on while
    # another compiles).
    with compilation.persistent_cache_off(), ThreadPoolExecutor(max_workers=len(result["rows"]) or 1) as pool:
        list(pool.map(one, result["rows"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the Markdown table and one JSON line, returns the result."""
    ns, server_args = parse_args(argv)
    run_jax_on_cpu_without_accelerator()  # before JAX is imported
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if server_args.model_path is not None:
        from sglang_tpu_qwen.bench.startup import resolve_model_path

        server_args.model_path = resolve_model_path(server_args.model_path)  # before this process takes the chip
    result = run(ns, server_args)
    line = json.dumps(result, default=str)
    print(format_table(result))
    print(line, flush=True)
    if ns.output_json:
        Path(ns.output_json).write_text(line + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
