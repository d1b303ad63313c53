"""Offline throughput: our in-process Engine against HF transformers `generate` on the same checkpoint.

Mirrors SGLang's ``python -m sglang.bench_offline_throughput`` (random dataset): a fixed batch of
seeded random prompts is generated greedily with ``min_new_tokens == max_new_tokens``, so every
prompt yields exactly ``--random-output-len`` tokens in both systems. The Engine gets the whole
batch at once (its scheduler batches up to ``--max-running-requests``); HF gets left-padded batches
of ``--hf-batch-size`` with an attention mask. The Engine compiles its fixed program set at startup
(engine/runner/buckets.py), then warms up on DIFFERENT prompts from the same distribution (seed + 1), flushes
its prefix cache, and times fresh prompts: nothing in the timed run is a cache hit, and the number of
compilations during it is printed (it must be 0). HF warms up on one batch. The decode step is split into
wall time per step, device time per step (the step's compiled programs replayed back to back on the
idle engine at the run's batch size and mean context), wall - device, and host time not hidden behind the
device measured directly: the time the device sat idle between the end of one decode step (its sampled ids
ready) and the dispatch of the next (bench/device_idle.py), on a second run of the same prompts: the meter
costs throughput itself, so the throughput figures come from the run without it. On a CPU backend the two
differ: the host's work runs on the cores the "device" uses, so it slows the device step while it overlaps
it (wall - device counts that; the idle time does not).

Usage: ``python -m sglang_tpu_qwen.bench_offline_throughput --num-prompts 32 --random-input-len 128
--random-output-len 64``. Prints a table and one JSON line; ``--output-json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

# Qwen3.5's ordinary (non-special) token ids are [0, 248044); ids from there up are special tokens.
NORMAL_ID_LIMIT = 248044
_ENGINE_FLAGS = ("max_running_requests", "page_size", "chunked_prefill_size", "max_total_tokens",
                 "disable_overlap_schedule", "speculative_algorithm", "speculative_num_steps")
_SPEC_COUNTERS = ("spec_verify_rows", "spec_accepted_tokens", "spec_draft_tokens")


@dataclass
class RunResult:
    """One timed run: wall time, token counts and the generated ids of each prompt."""

    elapsed_s: float
    input_tokens: int
    output_tokens: int
    output_ids: list[list[int]]
    warmup_s: float
    extra: dict[str, Any] | None = None

    def summary(self, num_prompts: int) -> dict[str, Any]:
        """Throughputs (tokens/s, requests/s) in SGLang's key names, plus the Engine's step figures."""
        return {**(self.extra or {}),
            "elapsed_s": self.elapsed_s,
            "warmup_s": self.warmup_s,
            "total_output_tokens": self.output_tokens,
            "request_throughput": num_prompts / self.elapsed_s,
            "output_throughput": self.output_tokens / self.elapsed_s,
            "total_throughput": (self.input_tokens + self.output_tokens) / self.elapsed_s,
        }


def sample_random_prompts(num_prompts: int, input_len: int, range_ratio: float, seed: int) -> list[list[int]]:
    """Seeded random prompts, like SGLang's ``random`` dataset but as token ids.

    Lengths are uniform integers in ``[max(1, int(input_len * range_ratio)), input_len]``; ids are
    uniform in ``[0, NORMAL_ID_LIMIT)`` (no special tokens). Raises ValueError for bad sizes.
    """
    if num_prompts <= 0 or input_len <= 0:
        raise ValueError(f"--num-prompts and --random-input-len must be positive, got {num_prompts}, {input_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    low = max(1, int(input_len * range_ratio))
    lens = rng.integers(low, input_len + 1, size=num_prompts)
    return [rng.integers(0, NORMAL_ID_LIMIT, size=int(n)).tolist() for n in lens]


def _greedy_params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": output_len, "min_new_tokens": output_len}


def run_engine(args: argparse.Namespace, prompts: list[list[int]], warmup_prompts: list[list[int]]
               ) -> tuple[RunResult, str]:
    """Warm up on `warmup_prompts`, flush the prefix cache, then time one `Engine.generate` over `prompts`.

    Returns (result, resolved model path); result.extra holds ``compilations_during_timed_run``,
    ``precompile`` (the startup stats), ``decode_steps``, ``decode_step_ms`` (wall per steady-state decode
    step), ``decode_blocked_ms`` (host blocked reading the sampled ids), ``decode_device_ms`` (replayed
    device time at the run's batch and mean context), ``decode_host_ms`` (wall - device) and
    ``decode_idle_ms`` (device idle waiting for the host, per step; ``decode_idle_pct`` of the wall time),
    measured on a second run of the same prompts (cache flushed) with the idle meter attached, whose output
    throughput is ``metered_output_throughput``. The engine is shut down before returning.
    """
    from sglang_tpu_qwen.bench.decode_timer import DecodeTimer, time_decode_step
    from sglang_tpu_qwen.bench.device_idle import measure_device_idle
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.engine.runner import compilation

    engine_kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    engine = Engine(model_path=args.model_path, **engine_kwargs)
    try:
        params = _greedy_params(args.random_output_len)
        start = time.perf_counter()
        engine.generate(input_ids=warmup_prompts, sampling_params=params)
        warmup_s = time.perf_counter() - start
        if not engine.flush_cache():
            raise RuntimeError("the prefix cache could not be flushed after the warm-up")
        if engine.grammar is not None:  # its background load (seconds of CPU) must not overlap the timed run
            with contextlib.suppress(Exception):  # a failed load only matters to constrained requests
                engine.grammar.backend()
        runner = engine.runner
        with runner.observers.attach(DecodeTimer()) as timer:
            spec_before = _spec_counters(engine)
            compiles = compilation.jit_compilations()
            start = time.perf_counter()
            replies = engine.generate(input_ids=prompts, sampling_params=params)
            elapsed = time.perf_counter() - start
            compiles = compilation.jit_compilations() - compiles
            spec = {k: v - spec_before[k] for k, v in _spec_counters(engine).items()}
            stats = dataclasses.replace(timer.stats)
            # The idle meter can perturb what it measures (a watcher thread, the interpreter's switch interval
            # lowered to 20 us), so it gets its own run of the same prompts. Measured at 128 rows on the 2-core
            # CPU: alternating processes with and without it, 7% lower on average (-16% to +1%); within one
            # process (this layout), the metered second run -7% to +8%: below the machine's noise, not zero by
            # design.
            if not engine.flush_cache():
                raise RuntimeError("the prefix cache could not be flushed after the timed run")
            with measure_device_idle(runner) as meter:
                compiles_metered = compilation.jit_compilations()
                start = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=params)
                metered_s = time.perf_counter() - start
                compiles += compilation.jit_compilations() - compiles_metered
                idle_s, idle_pairs = meter.idle_s()
            metered_wall_s = timer.stats.decode_wall_s - stats.decode_wall_s
        rows = min(len(prompts), args.max_running_requests)
        context = int(np.mean([len(p) for p in prompts])) + args.random_output_len // 2
        # A replayed plain decode step; under speculation the decode steps are verify steps, which it is not.
        device_ms = 0.0 if runner.spec_steps else 1e3 * time_decode_step(runner, rows, context).step_s
        model_path = engine.model_path
        precompile = engine.precompile_stats
    finally:
        engine.shutdown()
    replies = sorted(replies, key=lambda r: r["index"])
    steps = max(stats.decode_steps, 1)
    wall_ms = 1e3 * stats.decode_wall_s / steps
    extra = {"compilations_during_timed_run": compiles, "precompile": precompile,
             "decode_steps": stats.decode_steps, "decode_step_ms": wall_ms,
             "decode_blocked_ms": 1e3 * stats.decode_wait_s / max(stats.decode_waits, 1), "decode_device_ms": device_ms,
             "decode_host_ms": max(0.0, wall_ms - device_ms),
             "decode_idle_ms": 1e3 * idle_s / max(idle_pairs, 1),
             "decode_idle_pct": 100.0 * idle_s / metered_wall_s if metered_wall_s else 0.0,
             "metered_output_throughput": sum(len(r["output_ids"]) for r in replies) / metered_s,
             "decode_rows": rows, "decode_context": context,
             # Speculative decoding over the timed run: SGLang's accept length (tokens per request per verify
             # step) from the engine's counters; None when it is off.
             "spec_accept_length": (spec["spec_accepted_tokens"] / spec["spec_verify_rows"]
                                    if spec["spec_verify_rows"] else None), **spec}
    return RunResult(
        elapsed_s=elapsed,
        input_tokens=sum(r["meta_info"]["prompt_tokens"] for r in replies),
        output_tokens=sum(r["meta_info"]["completion_tokens"] for r in replies),
        output_ids=[list(r["output_ids"]) for r in replies],
        warmup_s=warmup_s,
        extra=extra,
    ), model_path


def _spec_counters(engine: Any) -> dict[str, int]:
    """The speculative-decoding counters of /get_server_info (zeros when it is off)."""
    state = engine.get_server_info()["internal_states"][0]
    return {k: int(state.get(k, 0)) for k in _SPEC_COUNTERS}


def run_hf(model_path: str, prompts: list[list[int]], output_len: int, batch_size: int) -> RunResult:
    """Time HF `generate` (fp32, greedy) over left-padded batches, after one warm-up batch.

    Uses ``AutoModelForCausalLM`` (Qwen3_5MoeForCausalLM for these checkpoints) on torch CPU with
    as many threads as CPUs. Raises ValueError when ``batch_size`` is not positive.
    """
    import torch
    import transformers

    if batch_size <= 0:
        raise ValueError(f"--hf-batch-size must be positive, got {batch_size}")
    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = NORMAL_ID_LIMIT  # any id: padded positions are masked out
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: generation continues at the right edge
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=pad_id)
        return out[:, width:].tolist()

    start = time.perf_counter()
    generate(batches[0])
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = [row for batch in batches for row in generate(batch)]
    elapsed = time.perf_counter() - start
    return RunResult(elapsed_s=elapsed, input_tokens=sum(len(p) for p in prompts),
                     output_tokens=sum(len(o) for o in outputs), output_ids=outputs, warmup_s=warmup_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags in SGLang's bench_offline_throughput names where they apply."""
    defaults = ServerArgs()
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench_offline_throughput",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model-path", default=None, help="HF model dir; default: the embedded tiny Qwen3.5-MoE; "
                   "'heldout': issue 12's held-out random checkpoint (bench/heldout_model.py).")
    p.add_argument("--num-prompts", type=int, default=32, help="Number of prompts.")
    p.add_argument("--random-input-len", type=int, default=128, help="Max prompt length (tokens).")
    p.add_argument("--random-output-len", type=int, default=64, help="Output tokens per prompt (exact).")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Prompt lengths are uniform in [input_len * ratio, input_len].")
    p.add_argument("--seed", type=int, default=1, help="Seed of the random prompts.")
    p.add_argument("--max-running-requests", type=int, default=defaults.max_running_requests)
    p.add_argument("--page-size", type=int, default=defaults.page_size)
    p.add_argument("--chunked-prefill-size", type=int, default=defaults.chunked_prefill_size)
    p.add_argument("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="Synchronous scheduling: the host builds each step after reading the last one's tokens.")
    p.add_argument("--speculative-algorithm", default=None, help="NEXTN: draft with the checkpoint's MTP layer.")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="Draft tokens per step (default 3).")
    p.add_argument("--hf-batch-size", type=int, default=32, help="Prompts per HF generate call.")
    p.add_argument("--skip-hf", action="store_true", help="Only run the Engine.")
    p.add_argument("--output-json", default=None, help="Also write the result JSON to this path.")
    return p.parse_args(argv)


def _backends() -> dict[str, Any]:
    import jax

    info: dict[str, Any] = {"jax": jax.default_backend(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch"] = "cpu"  # run_hf never moves the model off the CPU
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    return info


def format_table(result: dict[str, Any]) -> str:
    """The result as a human-readable table (one column per system)."""
    eng, hf = result["engine"], result["hf"]
    rows = [
        ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Total token throughput (tok/s)", "total_throughput", "{:.1f}"),
        ("Request throughput (req/s)", "request_throughput", "{:.3f}"),
        ("Timed run (s)", "elapsed_s", "{:.2f}"),
        ("Warm-up, not timed (s)", "warmup_s", "{:.2f}"),
        ("Output tokens", "total_output_tokens", "{}"),
    ]
    lines = [
        "=========== Offline throughput: Engine (JAX) vs HF transformers (torch) ===========",
        f"Model: {result['model_path']}",
        f"Prompts: {result['num_prompts']}  input tokens: {result['total_input_tokens']} "
        f"(len {result['input_len_min']}..{result['input_len_max']})  output len: {result['random_output_len']} "
        f"(greedy, min_new_tokens = max_new_tokens)",
        f"Devices: JAX on {result['backends']['jax']}, torch on {result['backends']['torch']} "
        f"({result['backends'].get('torch_threads')} threads); {result['backends']['cpu_count']} CPUs",
        "Engine: programs precompiled at startup, warm-up on other prompts of the same distribution, prefix "
        "cache flushed; HF warm-up ran one batch. Warm-ups are not timed.",
        f"Engine compilations during the timed run: {eng['compilations_during_timed_run']}",
        "Speculative decoding: " + ("off" if eng.get("spec_accept_length") is None else
                                    f"accept length {eng['spec_accept_length']:.2f} tokens per request per verify "
                                    f"step ({eng['spec_verify_rows']} verify rows; the decode-step split below "
                                    "counts plain decode steps only)"),
        f"Engine decode step ({eng['decode_steps']} steady-state steps, {eng['decode_rows']} rows, context "
        f"~{eng['decode_context']}): wall {eng['decode_step_ms']:.2f} ms = device {eng['decode_device_ms']:.2f} ms "
        f"+ {eng['decode_host_ms']:.2f} ms (blocked on the device {eng['decode_blocked_ms']:.2f} ms)",
        f"Host time not hidden (device idle waiting for the host): {eng['decode_idle_ms']:.2f} ms per decode step "
        f"= {eng['decode_idle_pct']:.1f}% of the wall time (a second run of the same prompts with the meter "
        f"attached: {eng['metered_output_throughput']:.1f} output tok/s)",
        f"{'':34}{'Engine':>14}{'HF (batch ' + str(result['hf_batch_size']) + ')':>18}",
    ]
    for label, key, fmt in rows:
        hf_cell = fmt.format(hf[key]) if hf else "skipped"
        lines.append(f"{label:34}{fmt.format(eng[key]):>14}{hf_cell:>18}")
    if hf:
        lines.append(f"Output throughput ratio Engine / HF: {result['output_throughput_ratio']:.2f}x")
        lines.append(f"Total throughput ratio Engine / HF:  {result['total_throughput_ratio']:.2f}x")
        lines.append(f"Greedy outputs token-identical: {result['greedy_identical']} / {result['num_prompts']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the table and one JSON line, returns the result dict.

    Keys: ``engine`` / ``hf`` (None with --skip-hf) each hold ``output_throughput`` and
    ``total_throughput`` (tokens/s), ``request_throughput`` (req/s), ``elapsed_s``, ``warmup_s``,
    ``total_output_tokens``; ``output_throughput_ratio`` and ``total_throughput_ratio`` are
    Engine / HF; ``greedy_identical`` counts prompts whose outputs match token for token.
    """
    args = parse_args(argv)
    run_jax_on_cpu_without_accelerator()
    if args.model_path == "heldout":
        from sglang_tpu_qwen.bench.heldout_model import ensure_heldout_model

        args.model_path = str(ensure_heldout_model())
    prompts = sample_random_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed)
    warmup = sample_random_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed + 1)
    engine_run, model_path = run_engine(args, prompts, warmup)
    hf_run = None if args.skip_hf else run_hf(model_path, prompts, args.random_output_len, args.hf_batch_size)

    eng = engine_run.summary(len(prompts))
    hf = hf_run.summary(len(prompts)) if hf_run else None
    result: dict[str, Any] = {
        "model_path": model_path,
        "num_prompts": len(prompts),
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "seed": args.seed,
        "input_len_min": min(len(p) for p in prompts),
        "input_len_max": max(len(p) for p in prompts),
        "total_input_tokens": engine_run.input_tokens,
        "hf_batch_size": args.hf_batch_size,
        "engine_args": {name: getattr(args, name) for name in _ENGINE_FLAGS},
        "backends": _backends(),
        "engine": eng,
        "hf": hf,
        "output_throughput_ratio": eng["output_throughput"] / hf["output_throughput"] if hf else None,
        "total_throughput_ratio": eng["total_throughput"] / hf["total_throughput"] if hf else None,
        "greedy_identical": (sum(a == b for a, b in zip(engine_run.output_ids, hf_run.output_ids, strict=True))
                             if hf_run else None),
    }
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(line + "\n")
    return result
