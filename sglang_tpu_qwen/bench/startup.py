"""Startup benchmark: how long the in-process Engine takes to become ready and to answer, cold and warm.

One run builds ``Engine(...)`` with the server's flags (what ``launch_server`` builds; every SGLang flag it
takes is accepted here, defaults unchanged; no HTTP: a chip is held by one process) and measures:

* ready: the constructor's wall time: weights loaded (the loader's own figure is reported apart), pools sized,
  every program of the fixed set compiled or loaded from the persistent compilation cache (precompile), the
  scheduler started;
* first reply: one short greedy generate after ready (``launch_server``'s warm-up prompt, ``--first-reply-tokens``
  tokens, ignore_eos), and the compilations it caused (0 when the precompiled set covers it);
* programs compiled vs loaded from the cache (``ModelRunner.precompile``'s stats, and the process's totals), and
  the compiled programs' largest temporaries when the engine reports them (``/get_server_info``
  ``program_memory``).

``--runs cold,warm`` runs the measurement in one subprocess per label, strictly one after the other (one
process at a time holds the chip): ``cold`` with an empty compilation cache directory (a fresh temporary one,
removed afterwards, or ``--compilation-cache-dir`` if given, which must then be empty), ``warm`` with the same
directory as the run before it (or ``--compilation-cache-dir`` / the default cache as it is). Without
``--runs`` one run happens in this process, with the cache as configured.

``--concurrent N`` then sends N requests at once (random token ids, ``--input-len`` tokens each,
``--output-len`` new tokens, greedy, ignore_eos, as SGLang's bench_serving) and reports output tok/s, the peak
number of running requests and the compilations during the run; ``--max-running-requests`` defaults to N then
(the memory flags stay at their defaults). ``--model-path shaped-35b`` builds (once) and serves the 35B-shaped
random checkpoint (embedded/shaped_35b.py) in a subprocess of its own.

Usage::

    python -m sglang_tpu_qwen.bench.startup --model-path shaped-35b --runs cold,warm
    python -m sglang_tpu_qwen.bench.startup --model-path shaped-35b --concurrent 64 --input-len 512 --output-len 128

Prints, per run, one JSON line and a Markdown table (header and rows); ``--output-json PATH`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.utils.host_allocator import run_jax_on_cpu_without_accelerator

logger = logging.getLogger("sglang_tpu_qwen.bench.startup")

SHAPED_35B = "shaped-35b"
FIRST_REPLY_PROMPT = "The capital city of France is"  # launch_server's warm-up request
RUN_LABELS = ("cold", "warm")
_WEIGHT_LOGGER = "sglang_tpu_qwen.engine.runner.weight_loading"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ServerArgs]:
    """The bench's flags and the server's (ServerArgs, SGLang names). Exits with status 2 on a bad flag."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench.startup",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--runs", default=None,
                       help="Comma-separated labels out of cold, warm: one subprocess per run, in order (cold: an "
                            "empty compilation cache; warm: the previous run's). Default: one run in this process.")
    bench.add_argument("--first-reply-tokens", type=int, default=8, help="New tokens of the first reply.")
    bench.add_argument("--concurrent", type=int, default=0,
                       help="After the first reply, send this many requests at once and report output tok/s.")
    bench.add_argument("--input-len", type=int, default=512, help="Prompt tokens of each concurrent request.")
    bench.add_argument("--output-len", type=int, default=128, help="New tokens of each concurrent request.")
    bench.add_argument("--seed", type=int, default=1, help="Seed of the concurrent requests' random prompts.")
    bench.add_argument("--output-json", default=None, help="Also write the result JSON to this path.")
    bench.add_argument("--run-label", default=None, help=argparse.SUPPRESS)  # set by --runs for its subprocesses
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    labels = ns.runs.split(",") if ns.runs else []
    if any(label not in RUN_LABELS for label in labels) or "cold" in labels[1:]:
        p.error(f"--runs takes labels out of {RUN_LABELS}, cold only first, got {ns.runs!r}")
    if ns.first_reply_tokens <= 0 or ns.concurrent < 0 or ns.input_len <= 0 or ns.output_len <= 0:
        p.error("--first-reply-tokens, --input-len and --output-len must be positive, --concurrent >= 0")
    given = sys.argv[1:] if argv is None else argv
    if ns.concurrent and not any(a.startswith("--max-running-requests") for a in given):
        ns.max_running_requests = max(ns.max_running_requests, ns.concurrent)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        p.error(str(e))
    return ns, server_args


def resolve_model_path(model_path: str | None) -> str | None:
    """``shaped-35b``: the 35B-shaped checkpoint's directory, built first if needed by
    ``python -m sglang_tpu_qwen.embedded.shaped_35b`` in a subprocess (it draws the weights on the device, which
    it releases on exit); anything else unchanged. Raises CalledProcessError when the build fails."""
    if model_path != SHAPED_35B:
        return model_path
    out = subprocess.run([sys.executable, "-m", "sglang_tpu_qwen.embedded.shaped_35b"], check=True,
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


class _WeightLoadTime(logging.Handler):
    """Reads the loader's "loaded weights from %s in %.1f s" record (engine/runner/weight_loading.py)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("loaded weights from") and isinstance(record.args, tuple):
            self.seconds = float(record.args[1])


class _PeakRunning:
    """Polls the scheduler's running list every 5 ms on a thread; ``peak`` is the largest length seen."""

    def __init__(self, engine: Any) -> None:
        self.peak = 0
        self._engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, len(self._engine.scheduler.running))

    def __enter__(self) -> _PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _cache_label(precompile: dict[str, Any] | None, cache_dir: str | None) -> str:
    """cold / warm / partial from what precompile compiled and loaded; off without a persistent cache."""
    if cache_dir is None:
        return "off"
    if not precompile:
        return "unknown"
    if precompile.get("from_cache", 0) == 0:
        return "cold"
    return "warm" if precompile.get("compiled", 0) == 0 else "partial"


def _concurrent(engine: Any, n: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """``n`` random-id prompts of ``input_len`` tokens sent in one generate call, ``output_len`` greedy tokens each
    (ignore_eos). Returns tokens, seconds, tok/s, the peak number of running requests and the compilations."""
    from sglang_tpu_qwen.bench.offline_throughput import sample_random_prompts
    from sglang_tpu_qwen.engine.runner import compilation

    prompts = sample_random_prompts(n, input_len, 1.0, seed)
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    compiles = compilation.jit_compilations()
    with _PeakRunning(engine) as peak:
        start = time.perf_counter()
        replies = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in replies)
    in_tokens = sum(r["meta_info"]["prompt_tokens"] for r in replies)
    return {"requests": n, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
            "input_tokens": in_tokens, "output_tokens": out_tokens, "output_throughput": out_tokens / elapsed,
            "total_throughput": (in_tokens + out_tokens) / elapsed, "peak_running": peak.peak,
            "compilations": compilation.jit_compilations() - compiles,
            "finish_reasons": sorted({r["meta_info"]["finish_reason"]["type"] for r in replies})}


def run_once(ns: argparse.Namespace, server_args: ServerArgs) -> dict[str, Any]:
    """One measurement in this process (see the module docstring); returns the result dict.

    Keys: ``model``, ``model_path``, ``platform``, ``device_kind``, ``devices``, ``cache`` (the run's label, else
    what precompile did: cold / warm / partial / off), ``compilation_cache_dir``, ``import_s`` (importing the
    engine and JAX), ``ready_s`` (the Engine constructor), ``weight_load_s`` (None when not logged),
    ``precompile`` (``programs``, ``compiled``, ``from_cache``, ``seconds``; None with --disable-precompile),
    ``jit_compilations`` / ``jit_compilations_from_cache`` (the process's totals at ready), ``first_reply_s``,
    ``first_reply_tokens``, ``first_reply_compilations``, ``to_first_reply_s`` (process start of the
    measurement to the first reply), ``program_memory`` (None when the engine does not report it),
    ``largest_temp_gib``, ``server`` (resolved flags and pool sizes), ``concurrent`` (None without --concurrent).
    The engine is shut down before returning.
    """
    t0 = time.perf_counter()
    import jax

    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.engine.runner import compilation

    import_s = time.perf_counter() - t0
    timer = _WeightLoadTime()
    weight_logger = logging.getLogger(_WEIGHT_LOGGER)
    weight_logger.addHandler(timer)
    if not weight_logger.isEnabledFor(logging.INFO):
        weight_logger.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        engine = Engine(server_args)
        ready_s = time.perf_counter() - start
    finally:
        weight_logger.removeHandler(timer)
    try:
        compiles = compilation.jit_compilations()
        start = time.perf_counter()
        reply = engine.generate(FIRST_REPLY_PROMPT, {"temperature": 0.0, "max_new_tokens": ns.first_reply_tokens,
                                                     "ignore_eos": True})
        first_reply_s = time.perf_counter() - start
        first_compiles = compilation.jit_compilations() - compiles
        to_first_reply_s = time.perf_counter() - t0
        info = engine.get_server_info()
        concurrent = (_concurrent(engine, ns.concurrent, ns.input_len, ns.output_len, ns.seed)
                      if ns.concurrent else None)
    finally:
        engine.shutdown()
    device = jax.devices()[0]
    precompile = info.get("precompile")
    program_memory = info.get("program_memory")
    temp = program_memory.get("max_temp_bytes") if isinstance(program_memory, dict) else None
    cache_dir = jax.config.jax_compilation_cache_dir or None
    split = info.get("memory_split") or {}
    return {
        "model": Path(engine.model_path).name, "model_path": engine.model_path,
        "platform": device.platform, "device_kind": device.device_kind, "devices": len(jax.devices()),
        "jax": jax.__version__,
        "cache": ns.run_label or _cache_label(precompile, cache_dir), "compilation_cache_dir": cache_dir,
        "import_s": import_s, "ready_s": ready_s, "weight_load_s": timer.seconds,
        "precompile": {k: v for k, v in precompile.items() if k != "program_memory"} if precompile else None,
        "jit_compilations": info.get("jit_compilations"),
        "jit_compilations_from_cache": info.get("jit_compilations_from_cache"),
        "first_reply_s": first_reply_s, "first_reply_tokens": len(reply["output_ids"]),
        "first_reply_compilations": first_compiles, "to_first_reply_s": to_first_reply_s,
        "program_memory": program_memory, "largest_temp_gib": temp / 2**30 if temp is not None else None,
        "server": {"max_running_requests": info.get("max_running_requests"),
                   "context_length": info.get("context_length"),
                   "chunked_prefill_size": info.get("chunked_prefill_size"),
                   "mem_fraction_static": info.get("mem_fraction_static"),
                   "memory_split": split},
        "concurrent": concurrent,
    }


_STARTUP_COLUMNS = ("model", "device", "cache", "ready (s)", "weights (s)", "precompile (s)",
                    "programs compiled / from cache", "first reply (s)", "largest temporaries (GiB)")
_CONCURRENT_COLUMNS = ("model", "device", "requests", "input / output tokens", "output tok/s", "total tok/s",
                       "elapsed (s)", "peak running", "compilations")


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_markdown(results: list[dict[str, Any]]) -> str:
    """The runs as Markdown tables: one startup row per run, then one throughput row per run with --concurrent."""
    def row(cells: list[str] | tuple[str, ...]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [row(_STARTUP_COLUMNS), row(["---"] * len(_STARTUP_COLUMNS))]
    for r in results:
        pre = r["precompile"] or {}
        programs = f"{pre['compiled']} / {pre['from_cache']}" if pre else "not precompiled"
        lines.append(row([r["model"], f"{r['device_kind']} ({r['platform']})", r["cache"], _fmt(r["ready_s"]),
                          _fmt(r["weight_load_s"]), _fmt(pre.get("seconds")), programs, _fmt(r["first_reply_s"], ".2f"),
                          _fmt(r["largest_temp_gib"], ".3f")]))
    conc = [r for r in results if r.get("concurrent")]
    if conc:
        lines += ["", row(_CONCURRENT_COLUMNS), row(["---"] * len(_CONCURRENT_COLUMNS))]
        for r in conc:
            c = r["concurrent"]
            lines.append(row([r["model"], f"{r['device_kind']} ({r['platform']})", str(c["requests"]),
                              f"{c['input_len']} / {c['output_len']}", _fmt(c["output_throughput"]),
                              _fmt(c["total_throughput"]), _fmt(c["elapsed_s"], ".2f"), str(c["peak_running"]),
                              str(c["compilations"])]))
    return "\n".join(lines)


def _without_runs(argv: list[str]) -> list[str]:
    """``argv`` without ``--runs X`` / ``--runs=X`` and ``--output-json``: what each run's subprocess gets."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--runs", "--output-json"):
            skip = True
            continue
        if a.startswith(("--runs=", "--output-json=")):
            continue
        out.append(a)
    return out


def run_sequence(argv: list[str], ns: argparse.Namespace, model_path: str | None) -> list[dict[str, Any]]:
    """One subprocess per label of ``--runs``, strictly in order; returns their results (each with
    ``process_s``, the subprocess's wall time from exec to exit).

    Raises:
        ValueError: a cold run with a non-empty ``--compilation-cache-dir``, or with the cache turned off.
        subprocess.CalledProcessError: a run failed (its output is on this process's stdout / stderr).
    """
    labels = ns.runs.split(",")  # parse_args: cold, if there, comes first
    own_tmp: str | None = None
    cache = ns.compilation_cache_dir
    if cache is not None and cache.strip().lower() in ("", "none"):
        raise ValueError("--runs needs the persistent compilation cache: drop --compilation-cache-dir none")
    if labels[0] == "cold":
        if cache is None:
            cache = own_tmp = tempfile.mkdtemp(prefix="sglang-startup-cache-")
        elif Path(cache).exists() and any(Path(cache).iterdir()):
            raise ValueError(f"a cold run needs an empty compilation cache; {cache} is not empty")
    results = []
    try:
        for label in labels:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                cmd = [sys.executable, "-m", "sglang_tpu_qwen.bench.startup", *_without_runs(argv),
                       "--run-label", label, "--output-json", str(out)]
                if model_path is not None:
                    cmd += ["--model-path", model_path]
                if cache is not None:
                    cmd += ["--compilation-cache-dir", cache]
                start = time.perf_counter()
                subprocess.run(cmd, check=True)
                result = json.loads(out.read_text())
                result["process_s"] = time.perf_counter() - start
                results.append(result)
    finally:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; prints each run's JSON line and the Markdown tables, returns the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, server_args = parse_args(argv)
    run_jax_on_cpu_without_accelerator()  # before JAX is imported (by run_once or the subprocesses)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    model_path = resolve_model_path(server_args.model_path)
    if ns.runs and ns.run_label is None:
        results = run_sequence(argv, ns, model_path)
        line = json.dumps({"runs": results})
    else:
        server_args.model_path = model_path
        results = [run_once(ns, server_args)]
        line = json.dumps(results[0])
    print(line)
    print(format_markdown(results), flush=True)
    if ns.output_json:
        Path(ns.output_json).write_text(line + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
