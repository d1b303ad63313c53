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
- ``planned ms``: the planner's decode step for the same chip, rows, context, page size, cache dtypes and KV pool
  (``tools.plan.plan`` on a deviceless one-chip topology after the engine is shut down: the server's decode and
  greedy sampling programs compiled for the chip, each instruction at its own roofline, HLO bytes at the HBM peak
  and declared kernel flops at the bf16 peak, summed one after another, the MoE layers' slowest device under
  uniform routing; one chip has no collectives), and ``planned / measured``.

``--profile DIR`` captures ``jax.profiler.trace`` over ``--profile-steps`` replayed decode steps at
``--profile-rows`` rows and prints the device time per step by category (the Pallas attention, GDN and FP8
kernels, the MoE grouped matmuls and routing, the lm_head, sampling, copies, the XLA parts of attention and GDN,
the rest), the time per program (its ops' self time, and on a device plane its span) and the 15 largest ops;
with speculative decoding on, the same for ``--profile-steps`` replayed draft + verify cycles at each of those
row counts, per cycle. Ops are named by the step's compiled programs (their op_name metadata carries
the model's named scopes, model/forward.py; ``--profile`` keys the persistent compilation cache by that metadata, so
the first such run compiles cold). Off a TPU the trace has no device plane: it says so and groups
the host plane's XLA ops instead (summed over the threads that run them: shares, not a step time).

With ``--speculative-algorithm NEXTN`` (and SGLang's ``--speculative-num-steps K --speculative-eagle-topk 1
--speculative-num-draft-tokens K+1``; the draft policy defaults to ``always``) on a checkpoint with an MTP layer,
each row count also gets its speculative draft + verify cycle (issue 43), on the same idle engine:

- ``cycle ms``: the programs one verify step dispatches (verify, then the commit: greedy sampling of its ``B x
  (K + 1)`` positions, the GDN commit, the drafts and the carry; the scheduler's own runner calls), replayed back
  to back
  (bench/decode_timer.py ``time_verify_cycle``, the same timing loop as the plain step), every row feeding
  ``K + 1`` distinct ids after ``--context - 1`` cached tokens; ``host dispatch ms``; compilations in the timed
  replay (must be 0); the programs of one cycle, recorded;
- its least HBM bytes by part: the planner's verify step (tools/plan/step_bytes.py ``step_min_bytes("verify")``:
  the verify forward over ``K + 1`` tokens, the commit's second pass over the GDN states and the decode snapshots
  at ``--accept-length``, and ``draft``: ``K`` MTP-layer passes, each reading the MTP layer, its touched experts
  and the lm_head), ``roofline ms``, ``roofline / measured`` and ``measured / roofline``;
- ``cycle / plain step``: its time over the plain decode step's of the same rows; ``planned ms``: the planner's
  verify step beside it; the replay's accept length and distinct ids (what could make it unlike serving);
- per program (verify, commit): its time ALONE (``--cycle-program-iters`` calls a window,
  default 5, 0: off; decode_timer.py ``time_cycle_programs``: the same runner calls, one at a time), its share of
  the roofline bytes (step_bytes.py ``program_min_bytes``) and measured / roofline, and the planner's program
  alone (its HLO bytes and planned ms): where a cycle's time over its roofline goes.

Prints Markdown tables and one JSON line (``--output-json PATH`` writes it too).
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

    bucket, rb, rows_rank = _bucket_bytes(runner, rows)
    parts = step_bytes.step_min_bytes(rb, "decode", rows_rank=rows_rank, tokens=1, prefix=context - 1,
                                      tokens_step=bucket.batch)
    return bucket, parts


def cycle_roofline_parts(runner: Any, rows: int, context: int,
                         accept_length: float = 1.0) -> tuple[Any, dict[str, float]]:
    """The decode bucket of ``rows`` rows and the least bytes one device moves in one speculative draft + verify
    cycle of it (the planner's "verify" step, tools/plan/build.py ``plan``: the verify forward over ``N = k + 1``
    tokens a row after ``context - 1`` cached ones, the commit's second pass over the GDN states plus the decode
    snapshots of ``accept_length / page_size`` of the rows, and ``draft``: the draft program's ``k`` MTP-layer
    passes, each reading the MTP layer, the experts its tokens touch, the lm_head and its KV), by part
    (step_bytes.PARTS, bytes). ``accept_length``: tokens a row accepts per cycle, in ``[1, N]``.

    Raises:
        ValueError: the runner has no speculative decoding, or ``accept_length`` is outside ``[1, N]``."""
    from sglang_tpu_qwen.tools.plan import step_bytes

    if not runner.spec_steps:
        raise ValueError("speculative decoding is off (--speculative-algorithm)")
    n_spec = runner.spec_steps + 1
    if not 1.0 <= accept_length <= n_spec:
        raise ValueError(f"accept length {accept_length} outside [1, {n_spec}]")
    bucket, rb, rows_rank = _bucket_bytes(runner, rows)
    prefix = context - 1
    parts = step_bytes.step_min_bytes(
        rb, "verify", rows_rank=rows_rank, tokens=n_spec, prefix=prefix, tokens_step=bucket.batch * n_spec,
        page_size=runner.sizing.page_size, accept_length=accept_length,
        draft=lambda: step_bytes.draft_min_bytes(runner.config, rb, n_spec, bucket.batch, rows_rank, prefix,
                                                 draft_vocab=runner.draft_vocab_size))
    return bucket, parts


def cycle_program_bytes(runner: Any, rows: int, parts: dict[str, float],
                        accept_length: float = 1.0) -> dict[str, float]:
    """The cycle's least bytes ``parts`` (:func:`cycle_roofline_parts` of the same rows) split by the program that
    moves them (tools/plan/step_bytes.py ``program_min_bytes``: verify, commit)."""
    from sglang_tpu_qwen.tools.plan import step_bytes

    _, rb, rows_rank = _bucket_bytes(runner, rows)
    return step_bytes.program_min_bytes(rb, "verify", parts, rows_rank=rows_rank, page_size=runner.sizing.page_size,
                                        accept_length=accept_length)


def _bucket_bytes(runner: Any, rows: int) -> tuple[Any, Any, int]:
    """(the decode bucket of ``rows`` rows, the runner's step_bytes.RunnerBytes, the bucket's rows per rank)."""
    from sglang_tpu_qwen.tools.plan import step_bytes

    dp = runner.sizing.dp
    bucket = runner.buckets.decode_bucket(-(-rows // dp))
    ep = runner.layout.ep if runner.layout is not None else 1
    return bucket, step_bytes.runner_bytes(runner, ep), bucket.batch // dp


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
    """One row count on an idle ``engine``: the replayed step's device time, the compilations during its timed
    replay, its roofline and ``programs``: the compiled programs one step dispatches, in order (one untimed step
    recorded first, which compiles what the replay needs where precompile was skipped)."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs, time_decode_step
    from sglang_tpu_qwen.engine.runner import compilation
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    runner = engine.runner
    bucket, parts = roofline_parts(runner, rows, context)
    limit = bucket.pages * runner.sizing.page_size
    if context > limit:
        raise ValueError(f"--context {context} exceeds the decode bucket's page table ({bucket.pages} pages x "
                         f"{runner.sizing.page_size} = {limit} tokens): raise --context-length")
    with recorded_programs(runner) as keys:
        time_decode_step(runner, bucket.batch, context, iters=1, windows=1, warmup=0)
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
            "roofline_over_measured": total / bw / device_s, "experts_touched": touched, "local_experts": local,
            "programs": [str(k) for k in keys]}


def measure_cycle(engine: Any, rows: int, context: int, chip_key: str, *, iters: int, windows: int,
                  accept_length: float = 1.0, plain_s: float | None = None,
                  program_iters: int = 0) -> dict[str, Any]:
    """One row count's speculative draft + verify cycle on an idle ``engine`` with speculative decoding on: the
    replayed cycle's device and host dispatch seconds (bench/decode_timer.py ``time_verify_cycle``), the
    compilations during the timed replay (must be 0), its roofline bytes by part (:func:`cycle_roofline_parts` at
    ``accept_length``) and seconds at the chip ``chip_key``'s HBM peak, both ratios, the ratio to the plain decode
    step ``plain_s`` (seconds, the same rows; None: not measured), the replay's accept length and distinct ids
    (``CycleReplay``), and ``programs``: the compiled programs one cycle dispatches, in order (one untimed cycle
    recorded before the timing). ``program_iters`` > 0 adds ``alone``: each program of the cycle timed alone
    (decode_timer.py ``time_cycle_programs``, ``program_iters`` calls a window), one entry per program in dispatch
    order with its seconds, its least bytes (:func:`cycle_program_bytes`), their seconds at the HBM peak and
    measured / roofline; ``alone_s`` their sum.

    Raises:
        ValueError: as :func:`cycle_roofline_parts` and ``time_verify_cycle``."""
    from sglang_tpu_qwen.bench.decode_timer import (
        CYCLE_PROGRAMS,
        recorded_programs,
        time_cycle_programs,
        time_verify_cycle,
    )
    from sglang_tpu_qwen.engine.runner import compilation
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    runner = engine.runner
    bucket, parts = cycle_roofline_parts(runner, rows, context, accept_length)
    with recorded_programs(runner) as keys:  # one cycle, untimed (it compiles what the replay needs)
        time_verify_cycle(runner, bucket.batch, context, iters=1, windows=1, warmup=0)
    compiles = compilation.jit_compilations()
    replay = time_verify_cycle(runner, bucket.batch, context, iters=iters, windows=windows)
    compiles = compilation.jit_compilations() - compiles
    chip = CHIPS[chip_key]
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    total = sum(parts.values())
    roofline_s = total / bw
    program_bytes = cycle_program_bytes(runner, rows, parts, accept_length)
    alone: list[dict[str, Any]] = []
    if program_iters > 0:
        times = time_cycle_programs(runner, bucket.batch, context, iters=program_iters, windows=windows)
        for name in CYCLE_PROGRAMS:
            t, b = times[name].step_s, program_bytes[name]
            alone.append({"program": name, "device_s": t, "dispatch_s": times[name].dispatch_s, "min_bytes": b,
                          "roofline_s": b / bw, "measured_over_roofline": t * bw / b if b else None})
    return {"rows": rows, "bucket_rows": bucket.batch, "context": context, "tokens_per_row": runner.spec_steps + 1,
            "device_s": replay.step_s, "dispatch_s": replay.dispatch_s, "compilations": compiles, "bytes": parts,
            "bytes_total": total, "roofline_s": roofline_s, "roofline_over_measured": roofline_s / replay.step_s,
            "measured_over_roofline": replay.step_s / roofline_s, "plain_s": plain_s,
            "over_plain": replay.step_s / plain_s if plain_s else None, "accept_length_bytes": accept_length,
            "accept_length_replay": replay.accept_length, "distinct_sampled": replay.distinct_sampled,
            "distinct_drafts": replay.distinct_drafts,
            # The lm_head rows each draft pass reads: the map's with --speculative-token-map.
            "draft_lm_head_bytes": float(runner.spec_steps * _bucket_bytes(runner, rows)[1].lm_head
                                         * (runner.draft_vocab_size or runner.config.vocab_size)
                                         / runner.config.vocab_size),
            "draft_vocab": runner.draft_vocab_size,
            "program_bytes": program_bytes, "alone": alone,
            "alone_s": sum(a["device_s"] for a in alone) if alone else None, "programs": [str(k) for k in keys]}


def plan_rows(engine_info: dict[str, Any], config: Any, chip_key: str, rows: int, context: int,
              speculative_num_draft_tokens: int = 0, accept_length: float | None = None) -> dict[str, Any]:
    """The planner's decode step of ``rows`` rows at ``context`` on one chip ``chip_key`` with the engine's page size,
    cache dtypes and KV pool (``engine_info["kv_tokens"]`` where given, :func:`settle_engine`; else every row at
    ``context``) (``tools.plan.plan``; compiles for a deviceless topology: run it with no engine serving).
    Returns ``planned_s`` (uniform routing), ``roofline_s``, ``min_bytes`` and its parts, ``bytes_ratio``; with
    ``speculative_num_draft_tokens`` N > 0 (and ``accept_length`` in [1, N]) also ``verify``: the same fields of
    the planner's verify step (the served verify and commit programs), or its error.
    ``programs``: each program of the step planned alone (``program``, ``hlo_bytes``, ``min_bytes``,
    ``serial_s``: its instructions one after another plus its undeclared XLA flops at the peak)."""
    from sglang_tpu_qwen.tools.plan import plan

    spec = dict(speculative_num_draft_tokens=speculative_num_draft_tokens, speculative_accept_length=accept_length,
                speculative_token_map=engine_info.get("speculative_token_map")) if speculative_num_draft_tokens else {}
    report = plan(config, ONE_CHIP_TOPOLOGY[chip_key], 1, 1, rows, context, page_size=engine_info["page_size"],
                  steps=("decode",), kv_cache_dtype=engine_info["kv_cache_dtype"],
                  mamba_ssm_dtype=engine_info["mamba_ssm_dtype"], max_total_tokens=engine_info.get("kv_tokens"),
                  **spec)

    def fields(step: dict[str, Any]) -> dict[str, Any]:
        if "error" in step:
            return {"error": step["error"]}
        return {"planned_s": step["planned_s"]["uniform"], "roofline_s": step["roofline_s"],
                "min_bytes": step["min_bytes"], "min_bytes_parts": step["min_bytes_parts"],
                "bytes_ratio": step["bytes_ratio"], "serial_s": step["serial_s"], "bucket_rows": step["rows"],
                "kernels": report["kernels"], "top_excess": step["top_excess"][:3],
                "programs": [{k: p[k] for k in ("program", "hlo_bytes", "min_bytes", "serial_s")}
                             for p in step["programs"]]}

    out = fields(report["steps"]["decode"])
    if speculative_num_draft_tokens:
        out["verify"] = fields(report["steps"]["verify"])
    return out


# ---- the profile ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One top-level instruction of a compiled program: its opcode and op_name metadata."""

    opcode: str
    op_name: str


def op_table(programs: list[tuple[str, str]]) -> dict[str, dict[str, OpInfo]]:
    """``{module name: {instruction name: OpInfo}}`` of compiled HLO texts (``(label, hlo_text)`` pairs; the module
    name is the text's ``HloModule`` line's, e.g. ``jit_forward_program``), every instruction the program runs
    (tools/hlo_traffic.py ``instruction_table``: a profile's op events name them, loop and control ops too)."""
    from sglang_tpu_qwen.tools import hlo_traffic

    out: dict[str, dict[str, OpInfo]] = {}
    for _, text in programs:
        m = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
        module = m.group(1) if m else ""
        table = out.setdefault(module, {})
        for name, (opcode, op_name) in hlo_traffic.instruction_table(text).items():
            table[name] = OpInfo(opcode, op_name)
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
    # The conv windows' DMAs (kernels/gdn/window_copy.py) run inside fused_gdn's scope: named before the kernel.
    ("GDN conv windows (DMA)", lambda t, op, module: _kernel(t, op) and "windows_dma" in t),
    ("GDN kernel (Pallas)", lambda t, op, module: _kernel(t, op) and "fused_gdn" in t),
    ("GDN snapshot copy (Pallas)", lambda t, op, module: _kernel(t, op) and "copy_slots" in t),
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
    "categories": [{"category", "ms_per_step", "share"}], "programs": [{"module", "ms_per_step", "share",
    "span_ms_per_step", "runs_per_step"}], "top_ops": [{"op", "module", "category", "opcode", "op_name",
    "ms_per_step", "share", "count"}]}`` (shares of the total; time in ms per step; a program's ``ms_per_step``
    sums its ops' self times, ``span_ms_per_step`` its XLA Modules events on a device plane, else None).
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
    per_module: dict[str, float] = {}
    for name, module, ns in rows:
        acc = per_op.setdefault((name, module), [0.0, 0])
        acc[0] += ns
        acc[1] += 1
        per_module[module] = per_module.get(module, 0.0) + ns
    spans: dict[str, list[float]] = {}  # device: each program's XLA Modules events (its span, gaps included)
    if source == "device":
        for e in mod_events:
            acc = spans.setdefault(_module_name(e.name), [0.0, 0])
            acc[0] += e.duration_ns
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
    programs = [{"module": m, "ms_per_step": ns / 1e6 / steps, "share": ns / total_ns if total_ns else 0.0,
                 "span_ms_per_step": spans[m][0] / 1e6 / steps if m in spans else None,
                 "runs_per_step": spans[m][1] / steps if m in spans else None}
                for m, ns in sorted(per_module.items(), key=lambda kv: -kv[1])]
    return {"source": source, "plane": plane_name, "steps": steps, "total_ms_per_step": total_ns / 1e6 / steps,
            "modules_ms_per_step": modules_ns / 1e6 / steps if modules_ns else None, "categories": categories,
            "programs": programs, "top_ops": ops[:TOP_OPS], "ops": ops}


def capture_profile(runner: Any, rows: int, context: int, steps: int, out_dir: str | Path) -> Path:
    """``jax.profiler.trace`` into ``out_dir`` over ``steps`` decode steps of ``rows`` rows at ``context``, replayed
    on the idle runner after two untimed ones (bench/decode_timer.py); returns the trace's ``.xplane.pb``.

    Raises:
        FileNotFoundError: the profiler wrote no trace."""
    return trace_replay(_decode_replay(runner, rows, context), steps, out_dir)


def _decode_replay(runner: Any, rows: int, context: int) -> Any:
    """``replay(iters, warmup)``: ``iters`` decode steps of ``rows`` rows at ``context`` after ``warmup`` (one
    window, bench/decode_timer.py ``time_decode_step``)."""
    from sglang_tpu_qwen.bench.decode_timer import time_decode_step

    return lambda iters, warmup: time_decode_step(runner, rows, context, iters=iters, windows=1, warmup=warmup)


def trace_replay(replay: Any, steps: int, out_dir: str | Path) -> Path:
    """``jax.profiler.trace`` into ``out_dir`` over ``replay(steps, 0)``, after an untimed ``replay(1, 2)`` (so the
    traced calls compile nothing); returns the trace's ``.xplane.pb``. ``replay(iters, warmup)``: runs ``warmup``
    untimed then ``iters`` replayed steps on an idle runner (a decode step here, a prefill in
    bench/prefill_step.py).

    Raises:
        FileNotFoundError: the profiler wrote no trace."""
    import jax

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    replay(1, 2)  # warm: the traced steps compile nothing
    start = time.time()
    with jax.profiler.trace(str(out)):
        replay(steps, 0)
    found = [p for p in out.rglob("*.xplane.pb") if p.stat().st_mtime >= start - 1]
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {out} after the trace")
    return max(found, key=lambda p: p.stat().st_mtime)


def profile_replay(replay: Any, programs: Any, steps: int, out_dir: str | Path) -> dict[str, Any]:
    """Capture (:func:`trace_replay`) ``steps`` calls of ``replay`` and aggregate them (:func:`aggregate_profile`)
    with the op table of ``programs()`` (called after the capture: ``(label, compiled HLO text)`` pairs of the
    programs the replay runs, :func:`op_table`); adds ``trace`` (the file)."""
    from jax.profiler import ProfileData

    path = trace_replay(replay, steps, out_dir)
    table = op_table(programs())
    return {**aggregate_profile(ProfileData.from_file(str(path)), table, steps), "trace": str(path)}


def profile_step(runner: Any, rows: int, context: int, steps: int, out_dir: str | Path) -> dict[str, Any]:
    """Capture (:func:`capture_profile`) and aggregate (:func:`aggregate_profile`) ``steps`` decode steps; adds
    ``trace`` (the file) and ``rows`` / ``context``."""
    bucket = runner.buckets.decode_bucket(-(-rows // runner.sizing.dp))
    result = profile_replay(_decode_replay(runner, bucket.batch, context),
                            lambda: profiled_programs(runner, bucket.batch), steps, out_dir)
    return {**result, "rows": bucket.batch, "context": context}


def profile_cycle(runner: Any, rows: int, context: int, cycles: int, out_dir: str | Path) -> dict[str, Any]:
    """Capture and aggregate (:func:`profile_replay`) ``cycles`` replayed speculative draft + verify cycles of
    ``rows`` rows at ``context`` (bench/decode_timer.py ``time_verify_cycle``), named by the programs one cycle
    dispatches (recorded from one untimed cycle); per cycle, with the per-program times (``programs``)."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs, time_verify_cycle

    bucket = runner.buckets.decode_bucket(-(-rows // runner.sizing.dp))
    with recorded_programs(runner) as keys:
        time_verify_cycle(runner, bucket.batch, context, iters=1, windows=1, warmup=0)
    unique = list(dict.fromkeys(keys))

    def programs() -> list[tuple[str, str]]:
        return [(str(k), runner.programs.get(k).as_text()) for k in unique]

    prof = profile_replay(lambda iters, warmup: time_verify_cycle(runner, bucket.batch, context, iters=iters,
                                                                  windows=1, warmup=warmup),
                          programs, cycles, out_dir)
    return {**prof, "rows": bucket.batch, "context": context, "unit": "cycle",
            "what": f"{cycles} replayed draft + verify cycles at {bucket.batch} rows x {context}"}


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
        "the dispatching thread's CPU time per step (near the device time: the host sets the pace).",
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
    if result.get("cycles"):
        lines += ["", format_cycles(result)]
    for prof in result.get("profiles", []):
        lines += ["", format_profile(prof)]
    return "\n".join(lines)


def format_cycles(result: dict[str, Any]) -> str:
    """The speculative draft + verify cycles as Markdown: what was replayed, one row per row count, then per row
    count the programs of one cycle, the draft's lm_head share and what could distort the replay."""
    spec, chip = result["engine"]["speculative"], result["chip"]
    k, n = spec["num_steps"], spec["num_draft_tokens"]
    lines = [
        f"MTP cycle ({k} drafts, {n} tokens verified per row; draft policy {spec['draft_policy']}): one verify step's "
        "programs replayed back to back as the scheduler dispatches them (bench/decode_timer.py time_verify_cycle: "
        f"verify, then the commit: greedy sampling of the B x {n} positions, GDN commit, drafts, carry), median of "
        f"{result['windows']} x "
        f"{result['iters']} cycles, every row feeding {n} distinct host ids after {result['context'] - 1} cached "
        "tokens; plain step: the decode step above, same rows. Roofline: the planner's verify step "
        f"(tools/plan/step_bytes.py: forward + the commit's GDN state pass + draft) at "
        f"{chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s"
        f"{'' if result['on_chip'] else ' (NOT this device: the ratios are no chip figures)'}, decode snapshots "
        f"at accept length {result['accept_length']:g}. Issue 43 asks measured / roofline <= 1.3 at 64 rows, "
        "<= 1.5 at 1 and 8.",
        "",
        "| rows (bucket) | cycle ms | host dispatch ms / cycle | plain step ms | cycle / plain step | lm_head GB | "
        "experts GB | other weights GB | GDN recurrent GB | GDN conv GB | KV read + write GB | embedding rows GB | "
        "draft GB | total GB | roofline ms | roofline / measured | measured / roofline | planned ms | "
        "planned / measured | accept length (replay) | compilations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cycles"]:
        b, p = c["bytes"], c.get("plan") or {}
        planned = (f"{p['planned_s'] * 1e3:.2f}", f"{p['planned_s'] / c['device_s']:.2f}") if "planned_s" in p \
            else ("n/a", "n/a")
        plain = (f"{c['plain_s'] * 1e3:.2f}", f"{c['over_plain']:.2f}") if c.get("plain_s") else ("n/a", "n/a")
        lines.append(
            f"| {c['rows']} ({c['bucket_rows']}) | {c['device_s'] * 1e3:.2f} | {c['dispatch_s'] * 1e3:.2f} | "
            f"{plain[0]} | {plain[1]} | {_gb(b['lm_head'])} | {_gb(b['experts'])} | {_gb(b['dense'])} | "
            f"{_gb(b['gdn_recurrent'])} | {_gb(b['gdn_conv'])} | {_gb(b['kv_read'] + b['kv_write'])} | "
            f"{_gb(b['embedding_rows'])} | {_gb(b['draft'])} | {_gb(c['bytes_total'])} | "
            f"{c['roofline_s'] * 1e3:.2f} | {c['roofline_over_measured']:.2f} | {c['measured_over_roofline']:.2f} | "
            f"{planned[0]} | {planned[1]} | {c['accept_length_replay']:.2f} | {c['compilations']} |")
    lines.append("")
    for c in result["cycles"]:
        progs = c["programs"]
        p = c.get("plan") or {}
        plan_note = f"planner failed: {p['error']}" if "error" in p else (
            f"planned least bytes {_gb(p['min_bytes'])} GB ("
            + ("the same as the table" if abs(p["min_bytes"] - c["bytes_total"]) <= 1e-6 * c["bytes_total"]
               else "NOT the table") + f"), HLO bytes / least {p['bytes_ratio']:.2f}") if p else "not planned"
        lines.append(
            f"- {c['rows']} rows: {len(progs)} programs per cycle ({', '.join(progs)}; the plain step "
            f"{len(c.get('plain_programs', []))}); draft "
            f"{_gb(c['bytes']['draft'])} GB = {k} MTP-layer passes, of which the lm_head {k} x = "
            f"{_gb(c['draft_lm_head_bytes'])} GB"
            + (f" (its rows of the {c['draft_vocab']} ids of --speculative-token-map)" if c.get("draft_vocab") else "")
            + f"; replay inputs: {c['distinct_sampled']} distinct sampled ids of "
            f"{c['bucket_rows'] * n}, {c['distinct_drafts']} distinct drafts of {c['bucket_rows'] * k} (few would "
            "route the MoE layers like one row: a cycle "
            f"faster than serving); {plan_note}.")
    per_program = [c for c in result["cycles"] if c.get("alone") or (c.get("plan") or {}).get("programs")]
    if per_program:
        lines += ["", "Per program (each alone: decode_timer.py time_cycle_programs, the same timing loop; roofline: "
                  "the cycle's least bytes split by the program that moves them, step_bytes.program_min_bytes; "
                  "planned: the planner's program alone, its instructions one after another plus its undeclared "
                  "XLA flops at the peak):", "",
                  "| rows (bucket) | program | alone ms | roofline GB | roofline ms | measured / roofline | "
                  "planned ms | planned HLO GB |", "|---|---|---|---|---|---|---|---|"]
        bw = chip["hbm_bytes_per_s"] / chip["devices_per_chip"]
        for c in per_program:
            alone = {a["program"]: a for a in c.get("alone") or []}
            planned = {p["program"]: p for p in (c.get("plan") or {}).get("programs") or []}
            for name, b in c["program_bytes"].items():
                a, pl = alone.get(name), planned.get(name)
                ratio = f"{a['measured_over_roofline']:.2f}" if a and a["measured_over_roofline"] else "n/a"
                alone_ms = f"{a['device_s'] * 1e3:.2f}" if a else "n/a"
                plan_ms, plan_gb = (f"{pl['serial_s'] * 1e3:.2f}", _gb(pl["hlo_bytes"])) if pl else ("n/a", "n/a")
                lines.append(f"| {c['rows']} ({c['bucket_rows']}) | {name} | {alone_ms} | {_gb(b)} | "
                             f"{b / bw * 1e3:.2f} | {ratio} | {plan_ms} | {plan_gb} |")
            if c.get("alone_s"):
                lines.append(f"| {c['rows']} ({c['bucket_rows']}) | sum alone (the cycle: "
                             f"{c['device_s'] * 1e3:.2f}) | {c['alone_s'] * 1e3:.2f} | {_gb(c['bytes_total'])} | "
                             f"{c['roofline_s'] * 1e3:.2f} | {c['alone_s'] / c['roofline_s']:.2f} | | |")
        lines.append("")
    lines.append("- Not in the replay: the scheduler's host work and reads between cycles (it reads each cycle's "
                 "accepted counts, drafts and tokens while the next verify step runs), a carried row's ids read "
                 "from the carry (same program, other data), decode snapshot writes (the roofline counts them).")
    return "\n".join(lines)


def format_profile(prof: dict[str, Any]) -> str:
    """The profile as Markdown: where its ops came from, the categories and the top ops."""
    if "error" in prof:
        return f"Profile at {prof.get('what') or str(prof['rows']) + ' rows'}: failed: {prof['error']}"
    what = prof.get("what") or f"{prof['steps']} decode steps at {prof['rows']} rows x {prof['context']}"
    unit = prof.get("unit", "step")
    head = f"Profile of {what} ({prof['trace']}): "
    if prof["source"] == "device":
        head += (f"device plane {prof['plane']}, XLA ops {prof['total_ms_per_step']:.2f} ms per {unit} (self time)"
                 + (f", XLA modules {prof['modules_ms_per_step']:.2f} ms" if prof.get("modules_ms_per_step") else ""))
    elif prof["source"] == "host":
        head += (f"no device plane in the trace (not a TPU): the host plane's XLA ops ({prof['plane']}), "
                 f"{prof['total_ms_per_step']:.2f} ms per {unit} summed over the threads that ran them (they run "
                 f"in parallel: shares, not a {unit} time)")
    else:
        return head + "no device plane and no XLA ops on the host plane: nothing to break down"
    lines = [head, "", f"| category | ms / {unit} | share |", "|---|---|---|"]
    lines += [f"| {c['category']} | {c['ms_per_step']:.3f} | {100 * c['share']:.1f}% |" for c in prof["categories"]]
    if prof.get("programs"):
        lines += ["", f"| program | ops ms / {unit} | share | program span ms / {unit} | runs / {unit} |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p['module'] or '(unknown)'} | {p['ms_per_step']:.3f} | {100 * p['share']:.1f}% | "
                  + (f"{p['span_ms_per_step']:.3f} | {p['runs_per_step']:g} |" if p.get("span_ms_per_step")
                     is not None else "n/a | n/a |") for p in prof["programs"]]
    lines += ["", f"| top {TOP_OPS} ops | program | category | ms / {unit} | share | runs / {unit} | op_name |",
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
    bench.add_argument("--cycle-program-iters", type=int, default=5,
                       help="With --speculative-algorithm: also time each program of the cycle alone, this many "
                            "calls a window (0: off).")
    bench.add_argument("--accept-length", type=float, default=1.0,
                       help="With --speculative-algorithm: the accept length (tokens per row per cycle) the "
                            "cycle's roofline and plan assume for the decode snapshots the commit writes (default "
                            "1.0: a random MTP layer's).")
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
            or not ns.profile_row_counts or ns.profile_row_counts[0] <= 0 or ns.profile_steps <= 0 \
            or ns.cycle_program_iters < 0:
        p.error("--rows, --iters, --windows, --profile-rows and --profile-steps must be positive, --context > 1, "
                "--cycle-program-iters >= 0")
    given = sys.argv[1:] if argv is None else argv
    if not any(a.startswith("--max-running-requests") for a in given):
        ns.max_running_requests = max(ns.row_counts + (ns.profile_row_counts if ns.profile else []))
    if ns.speculative_algorithm is not None and not any(a.startswith("--speculative-draft-policy") for a in given):
        ns.speculative_draft_policy = "always"  # the setting (the replay itself verifies every cycle)
    resolve_model_flag(ns)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        p.error(str(e))
    return ns, server_args


def resolve_model_flag(ns: argparse.Namespace) -> None:
    """``--model-path`` of the benchmarks: unset -> the 35B-shaped checkpoint (``shaped-35b``, built on first use),
    ``embedded`` -> None (the embedded model), else unchanged (a directory)."""
    if ns.model_path is None:
        from sglang_tpu_qwen.bench.startup import SHAPED_35B

        ns.model_path = SHAPED_35B
    elif ns.model_path == EMBEDDED:
        ns.model_path = None


def run(ns: argparse.Namespace, server_args: ServerArgs) -> dict[str, Any]:
    """Start the engine, measure every row count (and the profile, :func:`measure`), shut it down, then plan;
    returns the result dict (its keys: the tables', see :func:`format_table`)."""
    return run_engine(ns, server_args, measure,
                      lambda ns, result, config: _plan_all(ns, result, result["engine"], config, result["chip_key"]))


def run_engine(ns: argparse.Namespace, server_args: ServerArgs, measure_fn: Any, plan_fn: Any) -> dict[str, Any]:
    """A step benchmark's run (this one's and bench/prefill_step.py's): start the in-process Engine, take
    ``measure_fn(engine, ns, ready_s)``, shut the engine down, then ``plan_fn(ns, result, config)`` (the planner's
    deviceless compiles need the chip free); returns the result dict."""
    import jax

    from sglang_tpu_qwen.engine.engine import Engine

    if ns.profile:
        # The profile names ops by their op_name metadata (the model's named scopes): key the persistent cache by it,
        # so that no program comes from an entry another version of the code wrote (a cold start the first time).
        jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    start = time.perf_counter()
    engine = Engine(server_args)
    ready_s = time.perf_counter() - start
    config = engine.runner.config
    try:
        result = measure_fn(engine, ns, ready_s)
    finally:
        engine.shutdown()
    plan_fn(ns, result, config)
    return result


def measure(engine: Any, ns: argparse.Namespace, ready_s: float = 0.0) -> dict[str, Any]:
    """Every row count of ``ns`` (:func:`parse_args`) on the idle, started ``engine``: the plain decode step
    (:func:`measure_rows`), the draft + verify cycle where the engine decodes speculatively
    (:func:`measure_cycle`), and the profile with ``--profile`` (of the plain step, and of the cycle where the
    engine decodes speculatively). ``ready_s``: the engine's start, seconds (shown only). Returns the result dict
    without the plan (``run`` adds it after the engine is shut down)."""
    import jax

    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    device = jax.devices()[0]
    chip_key, on_chip = chip_for(device.device_kind)
    runner = engine.runner
    args = engine.server_args
    engine_info = settle_engine(engine, ready_s)
    result: dict[str, Any] = {
        "model": Path(engine.model_path).name, "model_path": engine.model_path, "platform": device.platform,
        "device_kind": device.device_kind, "jax": jax.__version__, "chip": dataclasses.asdict(CHIPS[chip_key]),
        "chip_key": chip_key, "on_chip": on_chip, "context": ns.context, "iters": ns.iters,
        "windows": ns.windows, "engine": engine_info, "rows": []}
    if runner.spec_steps:
        engine_info["speculative"] = {"num_steps": runner.spec_steps, "num_draft_tokens": runner.spec_steps + 1,
                                      "draft_policy": args.speculative_draft_policy}
        result["cycles"] = []
        result["accept_length"] = ns.accept_length
    for rows in ns.row_counts:
        r = measure_rows(engine, rows, ns.context, chip_key, iters=ns.iters, windows=ns.windows)
        logger.info("%d rows: %.3f ms per step, roofline %.3f ms", rows, r["device_s"] * 1e3, r["roofline_s"] * 1e3)
        result["rows"].append(r)
        if runner.spec_steps:
            c = measure_cycle(engine, rows, ns.context, chip_key, iters=ns.iters, windows=ns.windows,
                              accept_length=ns.accept_length, plain_s=r["device_s"],
                              program_iters=ns.cycle_program_iters)
            logger.info("%d rows: %.3f ms per draft + verify cycle (%.2f plain steps), roofline %.3f ms", rows,
                        c["device_s"] * 1e3, c["over_plain"], c["roofline_s"] * 1e3)
            c["plain_programs"] = r["programs"]
            result["cycles"].append(c)
    if ns.profile:
        result["profiles"] = []
        for rows in ns.profile_row_counts:
            kinds = [("step", profile_step)] + ([("cycle", profile_cycle)] if runner.spec_steps else [])
            for kind, fn in kinds:
                try:
                    prof = fn(runner, rows, ns.context, ns.profile_steps, Path(ns.profile) / f"{kind}{rows}")
                except Exception as e:  # the measurements above stand without it
                    logger.exception("profile failed")
                    prof = {"error": f"{type(e).__name__}: {e}", "rows": rows,
                            "what": f"{kind} at {rows} rows"}
                result["profiles"].append(prof)
    return result


def settle_engine(engine: Any, ready_s: float = 0.0) -> dict[str, Any]:
    """Let a started ``engine``'s background grammar load finish (seconds of CPU that must not overlap timed
    steps; a failed load only matters to constrained requests) and describe it: running requests, context length,
    page size, KV / GDN-state / compute dtypes, dp, the kernels, --speculative-token-map, its start (``ready_s``,
    seconds) and precompile stats, and ``kv_tokens``: each rank's KV pool in tokens (its pages but the trash page;
    the planner compiles the same pool)."""
    runner, args = engine.runner, engine.server_args
    if engine.grammar is not None:
        with contextlib.suppress(Exception):
            engine.grammar.backend()
    return {"max_running_requests": args.max_running_requests, "context_length": engine.context_length,
            "page_size": runner.sizing.page_size, "kv_dtype": runner.kv_dtype.name,
            "kv_cache_dtype": args.kv_cache_dtype, "mamba_ssm_dtype": runner.sizing.state_dtype.name,
            "dtype": runner.dtype.name, "dp": runner.sizing.dp, "ready_s": ready_s,
            "kv_tokens": (runner.sizing.num_pages - 1) * runner.sizing.page_size,
            "kernels": {"attention": runner.backends.attention.name, "gdn": runner.backends.gdn.name},
            "speculative_token_map": args.speculative_token_map, "precompile": engine.precompile_stats}


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
    spec = engine_info.get("speculative")
    n_spec = spec["num_draft_tokens"] if spec else 0
    if result["platform"] != "tpu":
        # Off a TPU the deviceless compile loads libtpu beside other processes that may hold its lockfile (the
        # tests and tools do the same); on a TPU this process loaded it already.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from concurrent.futures import ThreadPoolExecutor

    from sglang_tpu_qwen.engine.runner import compilation

    def one(r: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            r["plan"] = plan_rows(engine_info, config, chip_key, r["bucket_rows"], r["context"], n_spec,
                                  ns.accept_length if n_spec else None)
        except Exception as e:  # no libtpu, or a topology it does not know: the measurements stand
            logger.exception("the planner failed")
            r["plan"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        r["plan_compile_s"] = time.perf_counter() - start

    # The row counts' compiles run side by side (XLA compiles without the GIL); the persistent cache stays off
    # around all of them (plan() turns it off around its own compiles: one thread must not turn it back on while
    # another compiles).
    with compilation.persistent_cache_off(), ThreadPoolExecutor(max_workers=len(result["rows"]) or 1) as pool:
        list(pool.map(one, result["rows"]))
    for r, c in zip(result["rows"], result.get("cycles", []), strict=False):  # the verify step beside the cycle
        c["plan"] = r["plan"].pop("verify", None) or {"error": r["plan"].get("error", "not planned")}


def bench_main(ns: argparse.Namespace, server_args: ServerArgs, run_fn: Any, format_fn: Any) -> dict[str, Any]:
    """A step benchmark's entry (this one's and bench/prefill_step.py's): JAX on the CPU where no accelerator is
    found, logging, the model resolved before this process takes the chip, ``run_fn(ns, server_args)``; prints
    ``format_fn(result)`` and the result as one JSON line (also to ``--output-json``) and returns it."""
    run_jax_on_cpu_without_accelerator()  # before JAX is imported
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if server_args.model_path is not None:
        from sglang_tpu_qwen.bench.startup import resolve_model_path

        server_args.model_path = resolve_model_path(server_args.model_path)  # before this process takes the chip
    result = run_fn(ns, server_args)
    line = json.dumps(result, default=str)
    print(format_fn(result))
    print(line, flush=True)
    if ns.output_json:
        Path(ns.output_json).write_text(line + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the Markdown table and one JSON line, returns the result."""
    ns, server_args = parse_args(argv)
    return bench_main(ns, server_args, run, format_table)


if __name__ == "__main__":
    main()
