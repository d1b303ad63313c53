"""Prefill against its compute roofline and the planner's plan: device time, flops per token, and a profile.

``python -m sglang_tpu_qwen.bench.prefill_step [--model-path P] [--shapes 64x512,8x4096] [--profile DIR]``
(issue 44, "A prefill benchmark on the chip with the per-op profile, and the planner's v5e prefill beside it").
The prefill sibling of bench/decode_step.py: the same engine start, chip table, planner and profile code.

One in-process ``Engine`` (no sockets; one process holds the chip) with the server's default flags, except
``--max-running-requests``, which defaults to the largest ``R`` of ``--shapes`` (every server flag is accepted,
SGLang's names). Model: ``shaped-35b`` (the default: the random checkpoint shaped like Qwen3.5-35B-A3B, built on
first use), ``embedded`` (the embedded tiny model) or a checkpoint directory.

What is replayed, for each shape ``R x L`` (R prompts of L tokens):

- **the steps the scheduler forms** for R greedy prompts of L tokens, all waiting at once, nothing cached (no
  radix-cache hit), ``max_new_tokens`` 1: the chunks come from the scheduler's own choice
  (engine/scheduler/schedule_policy.py ``extend_chunks``: per step the extend bucket that feeds the most prompt
  tokens within ``--chunked-prefill-size`` and ``--max-prefill-tokens``, each chunk ending where the prefix cache
  wants a GDN snapshot, ``page_size * floor((L - 1) / page_size)``, as engine/scheduler/prefix_cache.py ``admit``
  sets it), and each step's inputs from the scheduler's own layout (schedule_batch.py ``ScheduleBatch.build``:
  the compiled bucket, finishing rows first, the sampling batch of the finishing rows). A prompt left with one
  token runs it in a decode step, as the scheduler does;
- **the runner calls the scheduler makes per step** (scheduler.py ``launch``): the forward program of the step's
  bucket, then, where rows finish their prompt, greedy sampling of those rows (with its ``head_rows`` program when
  they are fewer than the bucket's) and, under overlap scheduling (the default), ``keep_sampled``;
- **on the idle engine**: each row writes its new tokens' KV into the trash page and its GDN state into a
  running slot of its own (bench/decode_timer.py ``replay_rows_layout``, as the decode replay does); the prefix a
  later chunk attends over is read from arbitrary pages; the prompt ids are distinct seeded ids (``replay_ids``),
  so the MoE layers route as a real batch does;
- **timed** with the decode replay's loop (decode_timer.py ``replay``): all steps of the shape back to back, the
  median of ``--windows`` windows of ``--iters`` prefills, each window waited for once at its end; with
  ``--step-iters`` > 0 each step is also timed alone the same way.

Left out: the scheduler's host work between steps (admission, page allocation, building the batches, reading
the sampled ids), the prefix cache's GDN snapshot copies after chunks that end on a page boundary
(device_state.py ``copy_slots``: no program-table call), prompt logprobs, the MTP layer's drafts after a finishing
chunk (speculative decoding), and the first decode steps.

For each shape it prints: the steps (their buckets), ``device ms`` for the whole prefill, per replayed step
(the mean) and per prompt, prompt tokens per second, the compilations in the timed windows (must be 0), the
**flops per token** it counts (the planner's analytic count, tools/plan/flops.py ``analytic_flops_per_token``
at the mean visible context of a prompt's positions, ``int((L + 1) / 2)`` as tools/plan/build.py counts its
"prefill" step, plus one lm_head row per prompt: ``(L * analytic(int((L + 1) / 2)) + 2 * hidden * vocab) / L``),
the **compute roofline** (those flops at the chip's bf16 peak, tools/plan/chips.py) and roofline / measured, the
**HBM roofline** (the steps' least bytes, tools/plan/step_bytes.py: the weights read once per step, the experts
its tokens touch, the lm_head where it samples, KV and GDN state per row; at the HBM peak) so the bound is
visible, and the **planner's prefill** beside it: ``tools.plan`` on the deviceless one-chip topology after the
engine is shut down, its "prefill" step (one prompt's chunk of ``--chunked-prefill-size`` tokens from position
0, compiled for the chip), scaled per token: planned ms = the planned step / its tokens x R x L.

``--profile DIR`` captures ``jax.profiler.trace`` over ``--profile-steps`` replayed prefills of
``--profile-shape`` and prints their device time by category (decode_step.py's categories: the GDN and attention
kernels, the MoE grouped matmuls and routing, projections, ...) and the largest ops.

Prints Markdown tables and one JSON line (``--output-json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.bench import decode_step

logger = logging.getLogger("sglang_tpu_qwen.bench.prefill_step")

DEFAULT_SHAPES = ((64, 512), (8, 4096))


# ---- the steps the scheduler forms ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrefillSteps:
    """The steps that prefill ``rows`` prompts of ``length`` tokens (:func:`scheduled_steps`): ``batches`` the
    scheduler's ``ScheduleBatch`` of each step (host arrays: the forward's ``[B, T]`` ids and page table over the
    trash page and slot, the greedy sampling batch of its finishing rows or None), ``keep_sampled`` whether each
    sampling step also keeps its ids on the device (overlap scheduling)."""

    rows: int
    length: int
    batches: list[Any]
    keep_sampled: bool

    @property
    def tokens(self) -> int:
        """Prompt tokens of the shape, R x L."""
        return self.rows * self.length


def scheduled_steps(engine: Any, rows: int, length: int) -> PrefillSteps:
    """The steps the engine's scheduler runs to prefill ``rows`` greedy prompts of ``length`` tokens that arrive
    together, nothing cached, each generating one token (the module docstring says what that covers), laid out
    for a replay on the IDLE engine: every row's written positions on the trash page, a running GDN slot a request.

    Raises:
        ValueError: more rows than ``--max-running-requests``, ``length`` < 2 or past the page table, or dp > 1
            (one DP rank's layout only)."""
    from sglang_tpu_qwen.bench.decode_timer import replay_ids, replay_rows_layout
    from sglang_tpu_qwen.engine.io.request import Request
    from sglang_tpu_qwen.engine.io.sampling_params import SamplingParams
    from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch, ScheduleBatch
    from sglang_tpu_qwen.engine.scheduler.schedule_policy import extend_chunks
    from sglang_tpu_qwen.model.forward_batch import ForwardMode

    runner, args, sched = engine.runner, engine.server_args, engine.scheduler
    buckets, ps = runner.buckets, runner.sizing.page_size
    if runner.sizing.dp != 1:
        raise ValueError("the prefill replay lays out one DP rank's rows (--dp-size 1)")
    if not 0 < rows <= args.max_running_requests:
        raise ValueError(f"{rows} prompts: the engine runs 1 .. {args.max_running_requests} at once "
                         "(--max-running-requests)")
    if length < 2 or length > buckets.pages * ps:
        raise ValueError(f"prompts of {length} tokens: 2 .. {buckets.pages * ps} fit the page table "
                         f"({buckets.pages} pages x {ps}; raise --context-length)")
    cache = sched.policy.ranks[0].prefix_cache
    ids = replay_ids(runner.config.vocab_size, (rows, length))
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    # No detokenizer: nothing is read back (the scheduler's output processor is not run).
    reqs = [Request(rid=f"prefill-{i}", index=i, prompt_ids=ids[i].tolist(), params=params, max_new_tokens=1,
                    seed=0, sink=lambda _: None, detokenizer=None, admit_order=i + 1)  # type: ignore[arg-type]
            for i in range(rows)]
    target = ps * ((length - 1) // ps)  # prefix_cache.py ``admit``: the last page boundary before the last token
    for r in reqs:
        r.snapshot_targets = [target] if cache is not None and target > 0 else []

    batches: list[Any] = []
    while any(r.pending for r in reqs):
        picked = extend_chunks(reqs, buckets, args, 1, cache.next_target if cache is not None else lambda r: None)
        if not picked.reqs:  # prompts with one token left: the scheduler feeds it in a decode step
            left = [r for r in reqs if r.pending == 1]
            picked = PickedBatch(ForwardMode.DECODE, left, [1] * len(left))
        first = np.array([r.cached_len for r in picked.reqs])
        last = first + np.array(picked.extend_lens) - 1
        table, slots = replay_rows_layout(runner, len(picked.reqs), buckets.pages, first, last,
                                          row_ids=np.array([reqs.index(r) for r in picked.reqs]))
        for i, (r, n) in enumerate(zip(picked.reqs, picked.extend_lens, strict=True)):
            r.pages = table[i, : -(-(r.cached_len + n) // ps)].tolist()
            r.slot = int(slots[i])
        batches.append(ScheduleBatch.build(picked, buckets, sched.eos_ids, runner.config.vocab_size,
                                           images=sched.image_inputs))
        for r, n in zip(picked.reqs, picked.extend_lens, strict=True):
            r.cached_len += n
    return PrefillSteps(rows, length, batches, keep_sampled=sched.overlap)


def run_steps(runner: Any, steps: PrefillSteps, only: int | None = None) -> Any:
    """Dispatch the steps (all, or step ``only``) as the scheduler's ``launch`` does: forward, then, where rows
    finish, greedy sampling and ``keep_sampled``. Returns the last step's device output (its sampled ids, else its
    last hidden states) without waiting. For IDLE runners inside ``runner.side_steps()``."""
    out = None
    for batch in steps.batches if only is None else steps.batches[only : only + 1]:
        step = runner.forward(batch.forward)
        out = step.last
        if batch.sampling is not None:
            sampled = runner.sample(step, batch.sampling)
            if steps.keep_sampled:
                runner.keep_sampled(sampled)
            out = sampled.tokens
    return out


def time_prefill(runner: Any, steps: PrefillSteps, iters: int = 3, windows: int = 3, warmup: int = 1,
                 only: int | None = None) -> Any:
    """Seconds per replayed prefill of ``steps`` (all its steps back to back; step ``only`` alone where given):
    bench/decode_timer.py's ``ReplayTime`` from its timing loop (medians of ``windows`` windows of ``iters``,
    after ``warmup`` untimed). For IDLE engines only; observers do not see these steps."""
    from sglang_tpu_qwen.bench.decode_timer import replay

    timed, _ = replay(runner, lambda: run_steps(runner, steps, only), iters, windows, warmup)
    return timed


# ---- what a step counts -----------------------------------------------------------------------------------------
def prompt_flops(config: Any, length: int) -> float:
    """Matmul flops (2 per multiply-add) of prefilling one prompt of ``length`` tokens from position 0 and
    sampling its next token, as tools/plan/build.py counts its "prefill" step for one row: tools/plan/flops.py
    ``chunk_flops`` from position 0 plus one lm_head row."""
    from sglang_tpu_qwen.tools.plan.flops import chunk_flops, lm_head_flops

    return chunk_flops(config, length, 0) + lm_head_flops(config)


def step_flops(config: Any, batch: Any) -> float:
    """Matmul flops of the real rows of one step (a ``ScheduleBatch``; padding excluded): each row's new tokens
    (tools/plan/flops.py ``chunk_flops`` after its prefix), and one lm_head row per sampled row."""
    from sglang_tpu_qwen.tools.plan.flops import chunk_flops, lm_head_flops

    f = batch.forward
    total = sum(chunk_flops(config, int(n), int(p)) for p, n in zip(f.prefix_lens, f.extend_lens, strict=True) if n)
    return total + len(batch.sampling_reqs) * lm_head_flops(config)


def step_bytes(runner: Any, batch: Any) -> dict[str, float]:
    """The least bytes one step moves on the device, by part (tools/plan/step_bytes.py ``PARTS``): the weights
    once (the lm_head only where the step samples), the experts its real tokens touch under uniform routing, and
    per real row its embedding rows, the KV of its prefix and chunk read and its chunk's written, its GDN states
    written (a fresh prompt) or read and written (a later chunk)."""
    from sglang_tpu_qwen.tools.plan import step_bytes as sb

    rb = sb.runner_bytes(runner, runner.layout.ep if runner.layout is not None else 1)
    f = batch.forward
    tokens = int(f.extend_lens.sum())
    parts = sb.step_min_bytes(rb, "prefill", rows_rank=0, tokens=0, prefix=0, tokens_step=tokens)
    if batch.sampling is None:
        parts["lm_head"] = 0.0
    for p, n in zip(f.prefix_lens, f.extend_lens, strict=True):
        if not n:
            continue
        row = sb.step_min_bytes(rb, "prefill" if p == 0 else "decode", rows_rank=1, tokens=int(n), prefix=int(p),
                                tokens_step=tokens)
        for k in ("embedding_rows", "kv_read", "kv_write", "gdn_recurrent", "gdn_conv"):
            parts[k] += row[k]
    return parts


def describe_step(batch: Any) -> dict[str, Any]:
    """A step's shape: mode, bucket ``[B, T, P]``, real rows, prompt tokens fed, padded token slots ``B x T``,
    the rows' smallest and largest prefix, rows sampled."""
    f = batch.forward
    real = f.extend_lens > 0
    return {"mode": batch.mode.name.lower(), "bucket": [int(x) for x in (f.batch_size, f.input_ids.shape[1],
                                                                         f.page_table.shape[1])],
            "rows": int(real.sum()), "tokens": int(f.extend_lens.sum()), "padded_tokens": int(f.input_ids.size),
            "prefix": [int(f.prefix_lens[real].min()), int(f.prefix_lens[real].max())],
            "sampled": len(batch.sampling_reqs)}


# ---- measuring --------------------------------------------------------------------------------------------------
def measure_shape(engine: Any, rows: int, length: int, chip_key: str, *, iters: int, windows: int,
                  step_iters: int = 0) -> dict[str, Any]:
    """One shape on an idle ``engine``: the scheduler's steps (:func:`scheduled_steps`) replayed (one untimed
    prefill recorded first: ``programs``, the compiled programs it dispatches in order, and the compiles it
    needs where precompile was skipped), the device time of the whole prefill, the compilations in the timed
    windows, the flops per token and both rooflines on the chip ``chip_key``; ``step_iters`` > 0 also times each
    step alone. Times in seconds, flops, bytes.

    Raises:
        ValueError: as :func:`scheduled_steps`."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs
    from sglang_tpu_qwen.engine.runner import compilation
    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    runner, config = engine.runner, engine.runner.config
    steps = scheduled_steps(engine, rows, length)
    with recorded_programs(runner) as keys:
        time_prefill(runner, steps, iters=1, windows=1, warmup=0)
    compiles = compilation.jit_compilations()
    replay = time_prefill(runner, steps, iters=iters, windows=windows)
    compiles = compilation.jit_compilations() - compiles
    chip = CHIPS[chip_key]
    peak = chip.bf16_flops_per_s / chip.devices_per_chip
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    flops = rows * prompt_flops(config, length)
    per_step = []
    for i, batch in enumerate(steps.batches):
        d = describe_step(batch)
        parts = step_bytes(runner, batch)
        d.update(flops=step_flops(config, batch), bytes=sum(parts.values()), bytes_parts=parts)
        d["compute_roofline_s"], d["hbm_roofline_s"] = d["flops"] / peak, d["bytes"] / bw
        if step_iters > 0:
            d["device_s"] = time_prefill(runner, steps, iters=step_iters, windows=windows, only=i).step_s
        per_step.append(d)
    bytes_total = sum(d["bytes"] for d in per_step)
    device_s = replay.step_s
    compute_s, hbm_s = flops / peak, bytes_total / bw
    return {"rows": rows, "length": length, "tokens": steps.tokens, "num_steps": len(steps.batches),
            "device_s": device_s, "dispatch_s": replay.dispatch_s, "step_mean_s": device_s / len(steps.batches),
            "prompt_s": device_s / rows, "tokens_per_s": steps.tokens / device_s, "compilations": compiles,
            "flops": flops, "flops_per_token": flops / steps.tokens,
            "step_flops": sum(d["flops"] for d in per_step), "compute_roofline_s": compute_s,
            "roofline_over_measured": compute_s / device_s, "bytes": bytes_total, "hbm_roofline_s": hbm_s,
            "hbm_roofline_over_measured": hbm_s / device_s, "bound": "compute" if compute_s >= hbm_s else "HBM",
            "steps": per_step, "keep_sampled": steps.keep_sampled, "programs": [str(k) for k in keys]}


def plan_prefill(engine_info: dict[str, Any], config: Any, chip_key: str, max_length: int) -> dict[str, Any]:
    """The planner's prefill step on one chip ``chip_key`` with the engine's running requests, page size, chunked
    prefill size, cache dtypes and KV pool (``kv_tokens``: a smaller planned pool can fit on-chip memory, where
    XLA would stage it around each attention call); ``tools.plan.plan(steps=("prefill",))``, compiled for a
    deviceless topology: run it with no engine serving. ``max_length``: the longest prompt measured (the plan's
    context length is at least that and the chunk). Returns the step's ``planned_s`` (uniform routing),
    ``tokens`` (its rows x new tokens), ``planned_per_token_s``, ``analytic_flops`` / ``flops`` (its count / the
    larger of it and XLA's), ``roofline_s`` and its bound, ``min_bytes``, ``bytes_ratio``, ``serial_s``,
    ``bucket`` and the kernels."""
    from sglang_tpu_qwen.tools.plan import plan

    chunk = engine_info["chunked_prefill_size"]
    report = plan(config, decode_step.ONE_CHIP_TOPOLOGY[chip_key], 1, 1, engine_info["max_running_requests"],
                  max(max_length, chunk), page_size=engine_info["page_size"], chunked_prefill_size=chunk,
                  steps=("prefill",), kv_cache_dtype=engine_info["kv_cache_dtype"],
                  mamba_ssm_dtype=engine_info["mamba_ssm_dtype"], max_total_tokens=engine_info.get("kv_tokens"))
    step = report["steps"]["prefill"]
    if "error" in step:
        return {"error": step["error"]}
    tokens = step["rows"] * step["new_tokens_per_row"]
    return {"planned_s": step["planned_s"]["uniform"], "tokens": tokens,
            "planned_per_token_s": step["planned_s"]["uniform"] / tokens, "analytic_flops": step["analytic_flops"],
            "flops": step["flops"], "roofline_s": step["roofline_s"], "roofline_bound": step["roofline_bound"],
            "min_bytes": step["min_bytes"], "bytes_ratio": step["bytes_ratio"], "serial_s": step["serial_s"],
            "bucket": step["bucket"], "kernels": report["kernels"], "top_excess": step["top_excess"][:3]}


def measure(engine: Any, ns: argparse.Namespace, ready_s: float = 0.0) -> dict[str, Any]:
    """Every shape of ``ns`` (:func:`parse_args`) on the idle, started ``engine`` (:func:`measure_shape`), and the
    profile with ``--profile``. Returns the result dict without the plan (``run`` adds it after shutdown)."""
    import jax

    from sglang_tpu_qwen.tools.plan.chips import CHIPS

    device = jax.devices()[0]
    chip_key, on_chip = decode_step.chip_for(device.device_kind)
    info = decode_step.settle_engine(engine, ready_s)
    info["chunked_prefill_size"] = engine.server_args.chunked_prefill_size
    info["max_prefill_tokens"] = engine.server_args.max_prefill_tokens
    info["radix_cache"] = engine.scheduler.policy.ranks[0].prefix_cache is not None
    info["overlap"] = engine.scheduler.overlap
    result: dict[str, Any] = {
        "model": Path(engine.model_path).name, "model_path": engine.model_path, "platform": device.platform,
        "device_kind": device.device_kind, "jax": jax.__version__, "chip": dataclasses.asdict(CHIPS[chip_key]),
        "chip_key": chip_key, "on_chip": on_chip, "iters": ns.iters, "windows": ns.windows,
        "step_iters": ns.step_iters, "engine": info, "shapes": []}
    for rows, length in ns.shape_list:
        r = measure_shape(engine, rows, length, chip_key, iters=ns.iters, windows=ns.windows,
                          step_iters=ns.step_iters)
        logger.info("%d x %d: %.2f ms, %.0f tok/s, compute roofline / measured %.3f", rows, length,
                    r["device_s"] * 1e3, r["tokens_per_s"], r["roofline_over_measured"])
        result["shapes"].append(r)
    if ns.profile:
        rows, length = ns.profile_shape
        try:
            result["profile"] = profile_prefill(engine, rows, length, ns.profile_steps, Path(ns.profile))
        except Exception as e:  # the measurements above stand without it
            logger.exception("profile failed")
            result["profile"] = {"error": f"{type(e).__name__}: {e}", "rows": rows, "what": f"{rows} x {length}"}
    return result


def profile_prefill(engine: Any, rows: int, length: int, prefills: int, out_dir: str | Path) -> dict[str, Any]:
    """``jax.profiler`` trace of ``prefills`` replayed prefills of ``rows x length`` (bench/decode_step.py
    ``profile_replay``: its categories and top ops, per prefill), named by the compiled programs they dispatch."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs

    runner = engine.runner
    steps = scheduled_steps(engine, rows, length)
    with recorded_programs(runner) as keys:
        time_prefill(runner, steps, iters=1, windows=1, warmup=0)
    unique = list(dict.fromkeys(keys))

    def programs() -> list[tuple[str, str]]:
        return [(str(k), runner.programs.get(k).as_text()) for k in unique]

    prof = decode_step.profile_replay(
        lambda iters, warmup: time_prefill(runner, steps, iters=iters, windows=1, warmup=warmup), programs,
        prefills, out_dir)
    return {**prof, "rows": rows, "length": length, "unit": "prefill",
            "what": f"{prefills} replayed prefills of {rows} x {length} ({len(steps.batches)} steps each)"}


# ---- output -----------------------------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    """The result as Markdown: the setup, one row per shape, its steps, the plan and the profile."""
    chip, eng = result["chip"], result["engine"]
    not_chip = "" if result["on_chip"] else ", NOT this device: the ratios are no chip figures"
    lines = [
        f"Prefill: {result['model']} on {result['device_kind']} ({result['platform']}), JAX {result['jax']}; engine: "
        f"max running {eng['max_running_requests']}, context length {eng['context_length']}, chunked prefill "
        f"{eng['chunked_prefill_size']}, page {eng['page_size']}, compute {eng['dtype']}, KV {eng['kv_dtype']}, GDN "
        f"state {eng['mamba_ssm_dtype']}, kernels {eng['kernels']}, radix cache "
        f"{'on' if eng['radix_cache'] else 'off'}, overlap {'on' if eng['overlap'] else 'off'}; ready in "
        f"{eng['ready_s']:.1f} s",
        f"Rooflines: {chip['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16 and {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s "
        f"({chip['name']}{not_chip}). device time: the scheduler's steps for R greedy prompts of L tokens replayed "
        f"back to back on the idle engine (forward + the finishing rows' sampling), median of {result['windows']} x "
        f"{result['iters']} prefills. flops / token: the planner's analytic count at the prompt's mean context, "
        "plus one lm_head row per prompt.",
        "",
        "| R x L | steps | device ms | ms / step | ms / prompt | tok/s | GFLOP / token | compute roofline ms | "
        "**roofline / measured** | HBM GB | HBM roofline ms | HBM roofline / measured | bound | planned ms | "
        "planned / measured | host dispatch ms | compilations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    p = result.get("plan") or {}
    for r in result["shapes"]:
        planned = (f"{p['planned_per_token_s'] * r['tokens'] * 1e3:.1f}",
                   f"{p['planned_per_token_s'] * r['tokens'] / r['device_s']:.2f}") if "planned_s" in p \
            else ("n/a", "n/a")
        lines.append(
            f"| {r['rows']} x {r['length']} | {r['num_steps']} | {r['device_s'] * 1e3:.1f} | "
            f"{r['step_mean_s'] * 1e3:.2f} | {r['prompt_s'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['flops_per_token'] / 1e9:.4f} | {r['compute_roofline_s'] * 1e3:.1f} | "
            f"**{r['roofline_over_measured']:.3f}** | {r['bytes'] / 1e9:.2f} | {r['hbm_roofline_s'] * 1e3:.1f} | "
            f"{r['hbm_roofline_over_measured']:.3f} | {r['bound']} | {planned[0]} | {planned[1]} | "
            f"{r['dispatch_s'] * 1e3:.1f} | {r['compilations']} |")
    for r in result["shapes"]:
        lines += ["", f"Steps of {r['rows']} x {r['length']} ({r['tokens']} prompt tokens; programs per prefill: "
                  f"{len(r['programs'])}, {len(set(r['programs']))} distinct):", "",
                  "| step | mode | bucket B x T | rows | tokens | padded | prefix | sampled | GFLOP | compute "
                  "roofline ms | HBM GB | HBM roofline ms | device ms (alone) | tok/s (alone) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, d in enumerate(r["steps"]):
            alone = (f"{d['device_s'] * 1e3:.2f}", f"{d['tokens'] / d['device_s']:,.0f}") if "device_s" in d \
                else ("n/a", "n/a")
            lines.append(
                f"| {i} | {d['mode']} | {d['bucket'][0]} x {d['bucket'][1]} | {d['rows']} | {d['tokens']} | "
                f"{d['padded_tokens']} | {d['prefix'][0]}-{d['prefix'][1]} | {d['sampled']} | "
                f"{d['flops'] / 1e9:.1f} | {d['compute_roofline_s'] * 1e3:.2f} | {d['bytes'] / 1e9:.3f} | "
                f"{d['hbm_roofline_s'] * 1e3:.2f} | {alone[0]} | {alone[1]} |")
    lines.append("")
    if "planned_s" in p:
        lines.append(
            f"Plan ({result['plan_topology']}, tools.plan): its prefill step is one prompt's chunk from position 0 "
            f"(bucket {p['bucket']['batch']} x {p['bucket']['tokens']}, {p['tokens']} tokens): planned "
            f"{p['planned_s'] * 1e3:.2f} ms, {p['planned_per_token_s'] * 1e6:.3f} us / token (planned ms above: that "
            f"x R x L); its roofline {p['roofline_s'] * 1e3:.2f} ms ({p['roofline_bound']}), analytic "
            f"{p['analytic_flops'] / p['tokens'] / 1e9:.4f} GFLOP / token, HLO bytes / least bytes "
            f"{p['bytes_ratio']:.2f}.")
    elif p.get("error"):
        lines.append(f"Plan: the planner failed: {p['error']}")
    if result.get("plan_skipped"):
        lines.append(f"Plan: skipped ({result['plan_skipped']})")
    lines.append("Not in the replay: the scheduler's host work between steps, the prefix cache's GDN snapshot "
                 "copies, prompt logprobs, MTP drafts, the decode steps after the prompt.")
    if result.get("profile"):
        lines += ["", decode_step.format_profile(result["profile"])]
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------------------------
def _shapes(text: str) -> list[tuple[int, int]]:
    """``"64x512,8x4096"`` -> ``[(64, 512), (8, 4096)]``; ValueError on anything else."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        r, _, l_ = part.lower().partition("x")
        out.append((int(r), int(l_)))
    if not out or any(r <= 0 or l_ < 2 for r, l_ in out):
        raise ValueError(text)
    return out


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ServerArgs]:
    """The benchmark's flags and the server's (ServerArgs, SGLang names). Exits with status 2 on a bad flag."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench.prefill_step",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--shapes", default=",".join(f"{r}x{n}" for r, n in DEFAULT_SHAPES),
                       help="Comma-separated RxL: R prompts of L tokens each (default 64x512,8x4096).")
    bench.add_argument("--iters", type=int, default=3, help="Replayed prefills per timing window.")
    bench.add_argument("--windows", type=int, default=3, help="Timing windows (the median is reported).")
    bench.add_argument("--step-iters", type=int, default=5,
                       help="Also time each step alone, this many per window (0: do not).")
    bench.add_argument("--profile", default=None, metavar="DIR",
                       help="Capture a jax.profiler trace of replayed prefills into DIR and break it down.")
    bench.add_argument("--profile-shape", default=None, help="RxL of the profiled prefills (default: the first).")
    bench.add_argument("--profile-steps", type=int, default=2, help="Replayed prefills inside the trace.")
    bench.add_argument("--no-plan", action="store_true", help="Skip the planner's step (a deviceless compile).")
    bench.add_argument("--output-json", default=None, help="Also write the result JSON to this path.")
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    try:
        ns.shape_list = _shapes(ns.shapes)
        ns.profile_shape = _shapes(ns.profile_shape)[0] if ns.profile_shape else ns.shape_list[0]
    except ValueError:
        p.error(f"--shapes / --profile-shape take comma-separated RxL (R >= 1, L >= 2), got {ns.shapes!r}")
    if ns.iters <= 0 or ns.windows <= 0 or ns.step_iters < 0 or ns.profile_steps <= 0:
        p.error("--iters, --windows and --profile-steps must be positive, --step-iters >= 0")
    given = sys.argv[1:] if argv is None else argv
    if not any(a.startswith("--max-running-requests") for a in given):
        ns.max_running_requests = max(r for r, _ in [*ns.shape_list, ns.profile_shape])
    decode_step.resolve_model_flag(ns)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        p.error(str(e))
    return ns, server_args


def run(ns: argparse.Namespace, server_args: ServerArgs) -> dict[str, Any]:
    """Start the engine, measure every shape (:func:`measure`), shut it down, then plan; returns the result dict."""
    return decode_step.run_engine(ns, server_args, measure, plan_all)


def plan_all(ns: argparse.Namespace, result: dict[str, Any], config: Any) -> None:
    """The planner's prefill step (:func:`plan_prefill`) into ``result["plan"]``, or why it was skipped."""
    info, chip_key = result["engine"], result["chip_key"]
    if ns.no_plan:
        result["plan_skipped"] = "--no-plan"
        return
    if chip_key not in decode_step.ONE_CHIP_TOPOLOGY or info["dp"] != 1:
        result["plan_skipped"] = f"no one-chip topology for {chip_key} with dp {info['dp']}"
        return
    result["plan_topology"] = decode_step.ONE_CHIP_TOPOLOGY[chip_key]
    if result["platform"] != "tpu":  # see bench/decode_step.py ``_plan_all``
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    start = time.perf_counter()
    try:
        result["plan"] = plan_prefill(info, config, chip_key, max(r["length"] for r in result["shapes"]))
    except Exception as e:  # no libtpu, or a topology it does not know: the measurements stand
        logger.exception("the planner failed")
        result["plan"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    result["plan_compile_s"] = time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the Markdown tables and one JSON line, returns the result."""
    ns, server_args = parse_args(argv)
    return decode_step.bench_main(ns, server_args, run, format_table)


if __name__ == "__main__":
    main()
