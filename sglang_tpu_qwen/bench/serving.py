"""Online serving benchmark: an async HTTP load generator against a running server (SGLang's bench_serving).

Sends streamed requests to SGLang's native ``/generate`` (``--backend sglang``, prompts as ``input_ids``) or
to ``/v1/completions`` (``--backend sglang-oai``, token-id prompts) and measures, per request, time to first
token (TTFT) and the gaps between later streamed chunks (inter-token latency, ITL; one gap per chunk, as
SGLang counts it), plus the prompt tokens the server reports as served from its prefix cache
(``meta_info.cached_tokens`` in the final chunk, or OpenAI ``usage.prompt_tokens_details.cached_tokens``).

Datasets (seeded, token ids in [0, NORMAL_ID_LIMIT): no special tokens):
- ``random``: independent prompts, lengths uniform in [input_len * range_ratio, input_len] (outputs alike).
- ``generated-shared-prefix``: ``--gsp-num-groups`` groups of ``--gsp-prompts-per-group`` prompts; each
  prompt is its group's system prompt followed by its own question.
- ``multi-turn``: ``--mt-num-sessions`` concurrent sessions of ``--mt-num-turns`` turns; turn k sends the
  system prompt, every earlier user message and model reply (the server's ``output_ids``), and a new user
  message. Turns of a session are sequential; sessions run concurrently.
- ``agent``: agent traces over the same ``--mt-*`` sizes: turn 0 sends the shared system prompt
  (``--mt-system-prompt-len``) and the user's task (``--mt-turn-input-len``); every later turn appends a tool
  result of ``--agent-tool-result-len * --agent-tool-result-range-ratio`` .. ``--agent-tool-result-len`` random
  tokens (uniform) after the model's reply (``--mt-turn-output-len``, the tool call), so the context grows by
  a tool result and a reply per turn.

``--mt-lockstep`` (multi-turn and agent) sends turn k of every session only after turn k - 1 of every session
has finished: each wave's requests go out together, and what a server (or a router) holds when a wave starts
does not depend on how fast other sessions ran.

``--request-rate`` (requests/s, Poisson arrivals; inf = all at once) paces independent requests and the start
of sessions; ``--max-concurrency`` caps requests in flight. ``--ignore-eos`` (default on) fixes output lengths.
``--json-schema`` constrains every request of any dataset to a JSON Schema (``sampling_params.json_schema``, or
``response_format`` with ``--backend sglang-oai``): JSON text, ``@file``, or the bare flag for a built-in schema
of at least 64 records, longer than any usual output length, so constrained requests run to their length as
unconstrained ones do and the two output throughputs compare grammar overhead alone.

Report: completed/failed requests, duration (s), request / input / output / total throughput (per s), TTFT
and ITL mean/p50/p90/p99 (ms), prompt tokens, cached tokens, hit rate = cached / prompt tokens, and prefill
tokens computed = prompt - cached; printed as text and written as JSON with ``--output-file``. Cached tokens
come from each reply's usage fields (``meta_info.cached_tokens`` / ``usage.prompt_tokens_details``), which the
server fills from the same count as its ``cache_hit_tokens`` counter (``/get_server_info``), so they hold through
a router too.

``--profile`` (SGLang's flag and ``--profile-*`` options) asks the server for a jax.profiler trace of its steps
around the run (``/start_profile`` before, ``/stop_profile`` after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

# Qwen3.5's ordinary (non-special) token ids are [0, 248044).
NORMAL_ID_LIMIT = 248044

# The bare --json-schema workload: a list of records, too long to finish within the output length.
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "maxLength": 12},
                       "status": {"enum": ["active", "idle", "failed"]},
                       "score": {"type": "number"}},
        "required": ["id", "name", "status", "score"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


@dataclass
class Turn:
    """One request to send: new prompt tokens (appended to the session's history) and the output length."""

    new_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    """Measurements of one request. Times in seconds; itl holds one gap per streamed chunk after the first."""

    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # the token ids sent (multi-turn: history + new turn)
    error: str = ""


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(NORMAL_ID_LIMIT) for _ in range(n)]


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return rng.randint(max(1, int(n * ratio)), max(1, n))


def build_sessions(args: argparse.Namespace) -> list[list[Turn]]:
    """The dataset as sessions (lists of turns sent in order); random / shared-prefix sessions have one turn.

    Raises ValueError for non-positive sizes or a range ratio outside [0, 1].
    """
    rng = random.Random(args.seed)
    name = args.dataset_name
    if name == "random":
        if args.num_prompts <= 0 or not 0.0 <= args.random_range_ratio <= 1.0:
            raise ValueError("--num-prompts must be > 0 and --random-range-ratio in [0, 1]")
        r = args.random_range_ratio
        return [[Turn(_ids(rng, _length(rng, args.random_input_len, r)), _length(rng, args.random_output_len, r))]
                for _ in range(args.num_prompts)]
    if name == "generated-shared-prefix":
        if min(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_output_len) <= 0:
            raise ValueError("--gsp-* sizes must be positive")
        sessions = []
        for _ in range(args.gsp_num_groups):
            system = _ids(rng, args.gsp_system_prompt_len)
            sessions += [[Turn(system + _ids(rng, args.gsp_question_len), args.gsp_output_len)]
                         for _ in range(args.gsp_prompts_per_group)]
        rng.shuffle(sessions)  # groups interleave, as requests of many tenants would
        return sessions
    if name == "multi-turn":
        if min(args.mt_num_sessions, args.mt_num_turns, args.mt_turn_input_len, args.mt_turn_output_len) <= 0:
            raise ValueError("--mt-* sizes must be positive")
        system = _ids(rng, args.mt_system_prompt_len)
        return [[Turn((system if k == 0 else []) + _ids(rng, args.mt_turn_input_len), args.mt_turn_output_len)
                 for k in range(args.mt_num_turns)] for _ in range(args.mt_num_sessions)]
    if name == "agent":
        lo = int(args.agent_tool_result_len * args.agent_tool_result_range_ratio)
        if min(args.mt_num_sessions, args.mt_num_turns, args.mt_turn_input_len, args.mt_turn_output_len,
               args.agent_tool_result_len) <= 0 or not 0.0 <= args.agent_tool_result_range_ratio <= 1.0:
            raise ValueError("--mt-* and --agent-tool-result-len must be positive, the range ratio in [0, 1]")
        system = _ids(rng, args.mt_system_prompt_len)
        return [[Turn(system + _ids(rng, args.mt_turn_input_len), args.mt_turn_output_len)]
                + [Turn(_ids(rng, rng.randint(max(1, lo), args.agent_tool_result_len)), args.mt_turn_output_len)
                   for _ in range(args.mt_num_turns - 1)] for _ in range(args.mt_num_sessions)]
    raise ValueError(f"unknown --dataset-name {name!r}")


def json_schema_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --json-schema constraint as a dict: None without the flag, RECORDS_SCHEMA for the bare flag, else the
    flag's JSON text or the file it names with a leading '@'. Raises ValueError for text that is not JSON."""
    value = getattr(args, "json_schema", None)
    if value is None:
        return None
    if value == "records":
        return RECORDS_SCHEMA
    text = open(value[1:]).read() if value.startswith("@") else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema is not valid JSON: {e}") from None


def _sse_payloads(line: str) -> dict | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data == "[DONE]" else json.loads(data)


async def send_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int],
                       output_len: int) -> RequestResult:
    """Send one streamed request and measure it; errors are recorded in the result, never raised."""
    res = RequestResult(prompt_len=len(prompt), prompt=list(prompt))
    oai = args.backend == "sglang-oai"
    schema = getattr(args, "schema", None)
    if oai:
        url = "/v1/completions"
        body: dict[str, Any] = {"model": args.model or "default", "prompt": prompt, "max_tokens": output_len,
                                "temperature": 0.0, "stream": True, "ignore_eos": args.ignore_eos,
                                "stream_options": {"include_usage": True}}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    else:
        url = "/generate"
        body = {"input_ids": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": args.ignore_eos}}
        if schema is not None:
            body["sampling_params"]["json_schema"] = json.dumps(schema)
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                chunk = _sse_payloads(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if oai:
                    usage = chunk.get("usage")
                    if usage:
                        res.output_len = usage["completion_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    new = 1 if any(c.get("text") for c in chunk.get("choices", [])) else 0
                else:
                    ids = chunk.get("output_ids", [])
                    new = len(ids) - tokens
                    res.output_ids, res.output_len = list(ids), len(ids)
                    res.cached_tokens = chunk.get("meta_info", {}).get("cached_tokens", 0)
                if new > 0:
                    if tokens == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    tokens += new
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = tokens > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, sessions: list[list[Turn]]) -> tuple[list[RequestResult], float]:
    """Run every session (pacing and concurrency per the flags); returns all request results and duration (s)."""
    base = args.base_url or f"http://{args.host}:{args.port}"
    limit = args.max_concurrency or None
    sem = asyncio.Semaphore(limit) if limit else None
    rng = np.random.default_rng(args.seed)
    results: list[RequestResult] = []
    bar = tqdm(total=sum(len(s) for s in sessions), disable=args.disable_tqdm, desc="requests")

    # Lock-step: every session waits for all the others between turns (a failed session keeps arriving).
    barrier = asyncio.Barrier(len(sessions)) if getattr(args, "mt_lockstep", False) and sessions else None
    turns_max = max((len(s) for s in sessions), default=0)

    async def one_session(client: httpx.AsyncClient, turns: list[Turn], delay: float) -> None:
        await asyncio.sleep(delay)
        history: list[int] = []
        failed = False
        for k in range(turns_max if barrier is not None else len(turns)):
            if barrier is not None and k > 0:
                await barrier.wait()
            if failed or k >= len(turns):
                continue
            turn = turns[k]
            prompt = history + turn.new_ids
            if sem is not None:
                async with sem:
                    res = await send_request(client, args, prompt, turn.output_len)
            else:
                res = await send_request(client, args, prompt, turn.output_len)
            results.append(res)
            bar.update(1)
            if not res.ok:
                failed = True  # later turns depend on this reply
                if barrier is None:
                    return
                continue
            history = prompt + res.output_ids

    delays = np.zeros(len(sessions))
    if math.isfinite(args.request_rate) and args.request_rate > 0:
        delays = np.cumsum(rng.exponential(1.0 / args.request_rate, size=len(sessions)))
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout,
                                 limits=httpx.Limits(max_connections=limit)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one_session(client, s, float(d)) for s, d in zip(sessions, delays, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def summarize(results: Sequence[RequestResult], duration: float, num_requests: int) -> dict[str, Any]:
    """Aggregate metrics (SGLang's key names where they exist); latencies in ms, throughputs per second."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_len for r in ok)
    out = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "not_sent": num_requests - len(results),
        "duration": duration,
        "total_input_tokens": prompt, "total_output_tokens": out,
        "cached_tokens": cached, "prefill_tokens_computed": prompt - cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "request_throughput": len(ok) / duration, "input_throughput": prompt / duration,
        "output_throughput": out / duration, "total_throughput": (prompt + out) / duration,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for name, vals in (("ttft", [r.ttft for r in ok]), ("itl", [g for r in ok for g in r.itl])):
        arr = np.asarray(vals, dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else 0.0
        for q, key in ((50, "median"), (90, "p90"), (99, "p99")):
            m[f"{key}_{name}_ms"] = float(np.percentile(arr, q)) if arr.size else 0.0
    return m


def format_report(m: dict[str, Any]) -> str:
    """The metrics as an aligned text table."""
    rows = [("Completed requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Duration (s)", f"{m['duration']:.2f}"),
            ("Prompt tokens", m["total_input_tokens"]), ("Cached tokens", m["cached_tokens"]),
            ("Cache hit rate", f"{m['cache_hit_rate']:.3f}"),
            ("Prefill tokens computed", m["prefill_tokens_computed"]),
            ("Output tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Input throughput (tok/s)", f"{m['input_throughput']:.2f}"),
            ("Output throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total throughput (tok/s)", f"{m['total_throughput']:.2f}")]
    if m.get("accept_length") is not None:
        rows.append(("Accept length", f"{m['accept_length']:.2f}"))
    for name in ("ttft", "itl"):
        rows += [(f"{name.upper()} {k} (ms)", f"{m[f'{k}_{name}_ms']:.2f}") for k in ("mean", "median", "p90", "p99")]
    if m.get("json_schema"):
        rows.insert(0, ("Constraint", "json_schema (every request)"))
    rows += [("Error", e) for e in m["errors"]]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(["=" * 20 + " Serving Benchmark Result " + "=" * 20]
                     + [f"{k:<{width}}{v}" for k, v in rows] + ["=" * 66])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (SGLang's names)."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench_serving", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["sglang", "sglang-oai"], default="sglang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--base-url", default=None, help="overrides --host/--port, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name for --backend sglang-oai")
    p.add_argument("--dataset-name", choices=["random", "generated-shared-prefix", "multi-turn", "agent"],
                   default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="random dataset: number of prompts")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="write the metrics as JSON here")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=16)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--mt-num-sessions", type=int, default=8)
    p.add_argument("--mt-num-turns", type=int, default=8)
    p.add_argument("--mt-system-prompt-len", type=int, default=1024)
    p.add_argument("--mt-turn-input-len", type=int, default=128)
    p.add_argument("--mt-turn-output-len", type=int, default=64)
    p.add_argument("--mt-lockstep", action="store_true",
                   help="multi-turn / agent: send turn k of every session after turn k-1 of all has finished")
    p.add_argument("--agent-tool-result-len", type=int, default=4096, help="agent: longest tool result (tokens)")
    p.add_argument("--agent-tool-result-range-ratio", type=float, default=0.5,
                   help="agent: shortest tool result as a share of --agent-tool-result-len")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json-schema", nargs="?", const="records", default=None,
                   help="constrain every request to a JSON Schema: JSON text, @file, or bare for a built-in schema")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout (s)")
    p.add_argument("--profile", action="store_true",
                   help="trace the server's steps during the run (/start_profile before, /stop_profile after)")
    p.add_argument("--profile-output-dir", default=None,
                   help="server-side trace directory (a timestamped subdirectory per run; default: "
                        "$SGLANG_TORCH_PROFILER_DIR, else the server's --profile-dir)")
    p.add_argument("--profile-activities", nargs="+", default=["CPU", "GPU"], choices=["CPU", "GPU", "TPU", "MEM"])
    p.add_argument("--profile-start-step", type=int, default=None, help="start tracing at this server step")
    p.add_argument("--profile-steps", "--profile-num-steps", dest="profile_steps", type=int, default=None,
                   help="trace this many steps, then the server stops by itself")
    p.add_argument("--profile-prefix", default=None, help="subdirectory of the output directory")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    args.schema = json_schema_of(args)  # resolved once; None without --json-schema
    return args


def profile_call(args: argparse.Namespace, what: str) -> str:
    """POST /start_profile (SGLang's body from the --profile-* flags) or /stop_profile; returns the reply text.

    The output directory is a fresh timestamped subdirectory of --profile-output-dir (or of
    $SGLANG_TORCH_PROFILER_DIR), as SGLang's bench makes it; without either the server's default is used.
    Raises RuntimeError with the server's message on a non-200 reply."""
    base = args.base_url or f"http://{args.host}:{args.port}"
    body: dict[str, Any] = {}
    if what == "start":
        body = {"activities": args.profile_activities, "num_steps": args.profile_steps,
                "start_step": args.profile_start_step, "profile_prefix": args.profile_prefix}
        root = args.profile_output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR")
        if root:
            body["output_dir"] = os.path.join(os.path.abspath(root), f"{time.time():.6f}")
    r = httpx.post(f"{base}/{what}_profile", json={k: v for k, v in body.items() if v is not None}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"/{what}_profile: HTTP {r.status_code}: {r.text}")
    print(r.text.strip(), file=sys.stderr)
    return r.text


def _spec_counters(args: argparse.Namespace) -> dict[str, int]:
    """The server's speculative-decoding counters (/get_server_info internal_states; {} if it has none)."""
    base = args.base_url or f"http://{args.host}:{args.port}"
    try:
        state = httpx.get(f"{base}/get_server_info", timeout=30).json()["internal_states"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return {}
    return {k: int(state[k]) for k in ("spec_verify_rows", "spec_accepted_tokens") if k in state}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints the report, writes ``--output-file`` if given, returns the metrics dict.

    With ``--profile`` the server traces its steps during the run; ``metrics["profile"]["trace"]`` is the trace
    directory the server reported (None when --profile-steps ended it before the run did)."""
    args = parse_args(argv)
    sessions = build_sessions(args)
    if args.profile:
        profile_call(args, "start")
    spec_before = _spec_counters(args)
    results, duration = asyncio.run(run(args, sessions))
    metrics = summarize(results, duration, sum(len(s) for s in sessions))
    spec = {k: v - spec_before.get(k, 0) for k, v in _spec_counters(args).items()}
    # Speculative decoding over the run (SGLang's bench prints the server's accept length): None when off.
    metrics["accept_length"] = (spec["spec_accepted_tokens"] / spec["spec_verify_rows"]
                                if spec.get("spec_verify_rows") else None)
    if args.profile:
        trace = None
        if args.profile_steps is None:  # with a step count the server stops by itself, as in SGLang's bench
            reply = profile_call(args, "stop")
            trace = reply.split("Trace: ", 1)[1].strip() if "Trace: " in reply else None
        metrics["profile"] = {"trace": trace}
    metrics.update(backend=args.backend, dataset_name=args.dataset_name, num_requests=sum(len(s) for s in sessions),
                   json_schema=args.json_schema is not None,
                   max_concurrency=args.max_concurrency, seed=args.seed,
                   request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(metrics, f, indent=2)
    print(format_report(metrics), file=sys.stdout)
    return metrics
