"""A GDN snapshot promoted from the host tier against recomputing the same prefix.

For each prefix length L (a multiple of the page size) one Engine with a single device snapshot slot
serves a seeded random prompt of L + 1 tokens with max_new_tokens 1, four ways, timed end to end
(`Engine.generate`, the median of `--rounds`):
  miss    the cache flushed: the whole prompt is prefilled;
  device  a resend: the snapshot at L is on the device, one token is prefilled;
  host    the snapshot was pushed to the host tier by two filler prompts (one device slot), so the resend
          uploads it (promotion) and prefills one token.
Every host row checks that the snapshot came from the host tier (`snapshot_hits_host` rose by one, L tokens
cached) and that its token equals the miss's. The scheduler-thread time of each demotion is also measured,
asynchronous (the server's) against a blocking read (what demotion did before: it waited for the step
just launched). Finally the raw transfer of one snapshot of the model (write_slot from host arrays / read_slot,
each to completion, on a cache of its own).

Usage: `python -m sglang_tpu_qwen.bench.host_tier --lengths 256 1024 4096` (embedded model by default).
Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator


def _gen(engine: Any, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1})
    return time.perf_counter() - t0, out


def _mem(engine: Any) -> dict:
    return engine.get_server_info()["memory"]


def _timed_demotions(engine: Any, blocking: bool) -> list[float]:
    """Record the scheduler-thread seconds of each demotion; `blocking` swaps in a read that waits for the
    device (the old demotion)."""
    from sglang_tpu_qwen.memory import gdn_state

    cache = engine.scheduler.ranks[0].prefix_cache
    state = engine.runner.state
    log: list[float] = []
    demote = type(cache)._demote

    def timed(sid: int, key: tuple[int, ...]) -> None:
        t0 = time.perf_counter()
        demote(cache, sid, key)
        log.append(time.perf_counter() - t0)

    cache._demote = timed  # looked up on the instance
    if blocking:
        state.read_slot_async = lambda sid: gdn_state.read_slot(state.cache, sid)
    else:
        state.__dict__.pop("read_slot_async", None)
    return log


def _engine_rows(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from sglang_tpu_qwen.engine.engine import Engine

    longest = max(args.lengths)
    engine = Engine(model_path=args.model_path, max_gdn_snapshots=1, max_running_requests=4,
                    max_total_tokens=4 * (longest + 64), context_length=longest + 64)
    rng = np.random.default_rng(args.seed)
    rows, demotions = [], {"async": [], "blocking": []}
    try:
        for length in args.lengths:
            times: dict[str, list[float]] = {"miss": [], "device": [], "host": []}
            for rnd in range(args.rounds):
                prompt = rng.integers(0, 240000, size=length + 1).tolist()
                assert engine.flush_cache()
                t_miss, miss = _gen(engine, prompt)
                times["miss"].append(t_miss)
                t_dev, dev = _gen(engine, prompt)
                times["device"].append(t_dev)
                mode = "blocking" if rnd % 2 else "async"
                log = _timed_demotions(engine, blocking=mode == "blocking")
                for _ in range(2):  # one device slot: each filler's snapshot pushes the previous one out
                    _gen(engine, rng.integers(0, 240000, size=2 * 16 + 1).tolist())
                demotions[mode].extend(log)
                hits = _mem(engine)["snapshot_hits_host"]
                t_host, host = _gen(engine, prompt)
                if _mem(engine)["snapshot_hits_host"] != hits + 1 or host["meta_info"]["cached_tokens"] != length:
                    raise RuntimeError(f"L={length}: the resend did not hit the host tier "
                                       f"(cached {host['meta_info']['cached_tokens']})")
                if not host["output_ids"] == dev["output_ids"] == miss["output_ids"]:
                    raise RuntimeError(f"L={length}: tokens differ: miss {miss['output_ids']}, device hit "
                                       f"{dev['output_ids']}, host hit {host['output_ids']}")
                times["host"].append(t_host)
            row = {"prefix_tokens": length, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}}
            rows.append(row)
    finally:
        engine.shutdown()
    demo = {f"demotion_{k}_ms": 1e3 * statistics.median(v) if v else None for k, v in demotions.items()}
    return rows, demo


def _transfer_row(config: Any, repeats: int) -> dict:
    """Milliseconds to upload one snapshot (write_slot from host arrays, to completion) and to read one back
    (the first two of each, which compile, left out)."""
    import jax

    from sglang_tpu_qwen.memory import gdn_state
    from sglang_tpu_qwen.model.forward import init_cache

    cache = init_cache(config, 2, 16, 3, np.float32)
    conv, rec = gdn_state.read_slot(cache, 1)
    conv, rec = np.array(conv) + 1, np.array(rec) + 1  # own host buffers, as the host tier keeps them
    ups, downs = [], []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        cache = gdn_state.write_slot(cache, 2, conv, rec)
        jax.block_until_ready(cache)
        ups.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gdn_state.read_slot(cache, 2)
        downs.append(time.perf_counter() - t0)
    nbytes = conv.nbytes + rec.nbytes
    return {"snapshot_kib": nbytes / 2**10, "upload_ms": 1e3 * statistics.median(ups[2:]),
            "read_ms": 1e3 * statistics.median(downs[2:])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096],
                        help="prefix lengths, multiples of the page size (16)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run_jax_on_cpu_without_accelerator()
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.model.config import load_config

    rows, demo = _engine_rows(args)
    print(f"{'prefix':>8}{'miss ms':>10}{'device hit ms':>15}{'host hit ms':>13}{'miss / host':>13}")
    for r in rows:
        print(f"{r['prefix_tokens']:>8}{r['miss_ms']:>10.1f}{r['device_ms']:>15.1f}{r['host_ms']:>13.1f}"
              f"{r['miss_ms'] / r['host_ms']:>12.1f}x")
    print(f"demotion, scheduler-thread ms (median): async {demo['demotion_async_ms']:.3f}, "
          f"blocking {demo['demotion_blocking_ms']:.3f}")
    transfer = _transfer_row(load_config(str(args.model_path or ensure_embedded_model())), 9)
    print(f"one snapshot ({transfer['snapshot_kib']:.0f} KiB): upload {transfer['upload_ms']:.2f} ms, read "
          f"{transfer['read_ms']:.2f} ms")
    print(json.dumps({"rows": rows, **demo, "transfer": transfer}))


if __name__ == "__main__":
    main()
