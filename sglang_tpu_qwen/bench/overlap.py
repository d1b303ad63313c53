"""Decode steady state with and without overlap scheduling: how much host time the device waits for.

One Engine decodes `--batch` seeded random prompts of `--input-len` tokens for `--output-len` greedy tokens
(ignore_eos, so every request runs the whole length and the decode steps all have `--batch` rows), in
alternating runs with overlap scheduling off (as `--disable-overlap-schedule`) and on. The scheduler's steps
are timed from the scheduler thread; the steady state is the middle half of the full-batch decode steps.
After each run the same decode program (forward + greedy sampling, one bucket) is replayed back to back
without the scheduler, which gives the device time of one step; step time - device time is shown as a share
of the step. Host time not hidden behind the device is also measured directly: the time the device sat idle
between one decode step's sampled ids being ready and the next step's dispatch (bench/device_idle.py). On
a CPU backend "device" work runs on the same cores as the host, so host work slows the device step while it
overlaps it: step - replay counts that slowdown, the idle time does not.

Usage: `python -m sglang_tpu_qwen.bench.overlap --batch 32 --output-len 64` (embedded model by default).
Prints one table row per mode and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator


def _timed_steps(engine: Any) -> list[tuple[float, float, int, str]]:
    """Wrap the scheduler's step / launch to record (start, end, rows, mode) of every step that ran a batch."""
    sched = engine.scheduler
    log: list[tuple[float, float, int, str]] = []
    launched: list[Any] = []
    step, launch = sched.step, sched.launch

    def noting_launch(batch: Any) -> Any:
        launched.append(batch)
        return launch(batch)

    def timed() -> bool:
        launched.clear()
        t0 = time.perf_counter()
        ran = step()
        if launched:
            log.append((t0, time.perf_counter(), len(launched[0].reqs), launched[0].mode.value))
        return ran

    sched.launch, sched.step = noting_launch, timed  # the loop looks the methods up on the instance
    return log


def _device_step_s(engine: Any, rows: int, repeats: int) -> float:
    """Seconds per decode step (forward + greedy sampling) of `rows` rows, dispatched back to back: the
    fastest of 5 windows of `repeats` steps."""
    import jax

    from sglang_tpu_qwen.engine.runner.model_runner import SamplingBatch
    from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode

    runner = engine.runner
    bucket = runner.buckets.decode_bucket(-(-rows // runner.sizing.dp))
    b, p = bucket.batch, bucket.pages
    # Trash page 0 / slot 0: the numbers do not matter, the work does.
    fwd = ForwardBatch(ForwardMode.DECODE, np.ones((b, 1), np.int32), np.full(b, 8, np.int32), np.ones(b, np.int32),
                       np.zeros((b, p), np.int32), np.zeros(b, np.int32))
    batch = SamplingBatch.greedy(b)
    out = runner.sample(runner.forward(fwd), batch)
    jax.block_until_ready(out.tokens)
    best = float("inf")
    for _ in range(5):  # the least disturbed of 5 windows (other processes share the CPU)
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = runner.sample(runner.forward(fwd), batch)
        jax.block_until_ready(out.tokens)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One Engine; timed decode runs alternating synchronous and overlapped steps (`--rounds` of each, the
    scheduler's `overlap` switch flipped between runs, so both modes see the same machine load), each
    followed by a device-only replay. Returns per-mode medians (ms, %)."""
    from sglang_tpu_qwen.bench.device_idle import measure_device_idle
    from sglang_tpu_qwen.engine.engine import Engine

    sargs = ServerArgs.from_kwargs(model_path=args.model_path, max_running_requests=args.batch,
                                   chunked_prefill_size=max(args.batch * args.input_len, 256),
                                   max_total_tokens=args.batch * (args.input_len + args.output_len + 64),
                                   disable_radix_cache=True, disable_precompile=args.disable_precompile)
    engine = Engine(sargs)
    try:
        rng = np.random.default_rng(args.seed)
        sp = {"temperature": 0.0, "max_new_tokens": args.output_len, "ignore_eos": True}
        warm = rng.integers(100, 200000, size=(args.batch, args.input_len)).tolist()
        engine.generate(input_ids=warm, sampling_params=sp)  # compile whatever precompile skipped
        log = _timed_steps(engine)
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for overlap in (False, True):
                engine.scheduler.overlap = overlap  # read at every step; the engine is idle here
                log.clear()
                prompts = rng.integers(100, 200000, size=(args.batch, args.input_len)).tolist()
                with measure_device_idle(engine.runner) as meter:
                    t0 = time.perf_counter()
                    engine.generate(input_ids=prompts, sampling_params=sp)
                    wall = time.perf_counter() - t0
                    idle_s, pairs = meter.idle_s()
                full = [s for s, _, rows, mode in log if mode == "decode" and rows == args.batch]
                mid = full[len(full) // 4 : len(full) - len(full) // 4]
                step_s = float(np.median(np.diff(mid))) if len(mid) > 2 else float("nan")
                device_s = _device_step_s(engine, args.batch, args.repeats)
                runs[overlap].append({"step_s": step_s, "device_s": device_s, "steps": len(full),
                                      "idle_s": idle_s / max(pairs, 1),
                                      "tok_s": args.batch * args.output_len / wall})
    finally:
        engine.shutdown()
    rows = []
    for overlap, rs in runs.items():
        step_s = float(np.median([r["step_s"] for r in rs]))
        device_s = float(np.median([r["device_s"] for r in rs]))
        exposed = max(0.0, step_s - device_s)
        idle_s = float(np.median([r["idle_s"] for r in rs]))
        rows.append({"overlap": overlap, "decode_steps": rs[0]["steps"], "step_ms": 1e3 * step_s,
                     "device_ms": 1e3 * device_s, "exposed_host_ms": 1e3 * exposed,
                     "exposed_host_pct": 100.0 * exposed / step_s,
                     "device_idle_ms": 1e3 * idle_s, "device_idle_pct": 100.0 * idle_s / step_s,
                     "output_tok_s": float(np.median([r["tok_s"] for r in rs])),
                     "runs": rs})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="device-only replays per timing window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per mode (alternating)")
    parser.add_argument("--disable-precompile", action="store_true")
    args = parser.parse_args(argv)
    run_jax_on_cpu_without_accelerator()
    rows = run(args)
    print(f"{'mode':<10}{'step ms':>10}{'device ms':>11}{'step-device ms':>16}{'%':>7}{'device idle ms':>16}"
          f"{'%':>7}{'tok/s':>9}")
    for r in rows:
        print(f"{'overlap' if r['overlap'] else 'sync':<10}{r['step_ms']:>10.2f}{r['device_ms']:>11.2f}"
              f"{r['exposed_host_ms']:>16.2f}{r['exposed_host_pct']:>6.1f}%{r['device_idle_ms']:>16.2f}"
              f"{r['device_idle_pct']:>6.1f}%{r['output_tok_s']:>9.0f}")
    print(json.dumps({"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
                      "modes": rows}))


if __name__ == "__main__":
    main()
