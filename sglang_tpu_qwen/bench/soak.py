"""Soak test against a running server: many concurrent clients, mixed traffic, then a check that nothing leaked.

`python -m sglang_tpu_qwen.bench.soak --base-url http://127.0.0.1:30000 --clients 64 --duration 150`

Each client loops until the duration ends, picking one of: a /generate request (plain or streamed), an OpenAI
chat stream with `continuous_usage_stats`, a stream it drops after a chunk or two (a client disconnect), a
stream it aborts through /abort_request, and a JSON-schema constrained request (string properties bounded by
maxLength, pattern and enum). Counted as errors: an unexpected status, a transport error, a stream without
`[DONE]`, streamed text that does not add up to the final text, an abort that does not end the stream as
aborted. A constrained answer that finished with "stop" must pass `json.loads(strict=True)` and
`jsonschema.validate`. After the run it waits for the server to go idle, flushes the prefix cache and reads
/get_server_info: every KV page and GDN slot must be free. Prints the figures as JSON; exit status 1 if any
error, leak or invalid constrained answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "pattern": "^[A-Z][a-z0-9]{0,5}$"},
        "kind": {"enum": ["alpha", "beta\tgamma", "delta"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "code", "kind", "count"],
    "additionalProperties": False,
}
WORDS = ("the river under stone light quiet number seven blue market clock winter paper tower seed "
         "signal orbit maple glass").split()
KINDS = ("generate", "generate_stream", "chat_stream", "disconnect", "abort", "json")


@dataclass
class Tally:
    """What the clients saw."""

    requests: Counter = field(default_factory=Counter)  # by kind
    errors: list[str] = field(default_factory=list)
    invalid_json: list[str] = field(default_factory=list)
    constrained_checked: int = 0


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def _data_lines(text_lines: list[str]) -> tuple[list[dict], bool]:
    chunks, done = [], False
    for line in text_lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(payload))
    return chunks, done


async def _generate(client: httpx.AsyncClient, rng: random.Random, tally: Tally, stream: bool) -> None:
    body = {"text": _prompt(rng), "stream": stream,
            "sampling_params": {"max_new_tokens": rng.randint(1, 32), "temperature": rng.choice([0.0, 0.7, 1.0])}}
    if not stream:
        r = await client.post("/generate", json=body)
        if r.status_code != 200:
            tally.errors.append(f"generate: {r.status_code} {r.text[:200]}")
        return
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            tally.errors.append(f"generate_stream: {r.status_code}")
            return
        chunks, done = _data_lines([line async for line in r.aiter_lines()])
    if not done or not chunks:
        tally.errors.append("generate_stream: no [DONE]")
        return
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        if not cur["text"].startswith(prev["text"]):
            tally.errors.append("generate_stream: text shrank")
            return


async def _chat_stream(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": _prompt(rng)}],
            "max_tokens": rng.randint(1, 32), "stream": True, "n": rng.choice([1, 2]),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            tally.errors.append(f"chat_stream: {r.status_code}")
            return
        chunks, done = _data_lines([line async for line in r.aiter_lines()])
    if not done or not chunks or chunks[-1].get("usage") is None:
        tally.errors.append("chat_stream: no [DONE] or no final usage")
    elif any(c.get("usage") is None for c in chunks):
        tally.errors.append("chat_stream: a chunk without continuous usage")


async def _disconnect(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"text": _prompt(rng), "stream": True, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    keep = rng.randint(1, 3)
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            tally.errors.append(f"disconnect: {r.status_code}")
            return
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= keep:
                    break  # leaving the block closes the connection: a client disconnect


async def _abort(client: httpx.AsyncClient, rng: random.Random, tally: Tally, rid: str) -> None:
    body = {"text": _prompt(rng), "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": 128, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            tally.errors.append(f"abort: {r.status_code}")
            return
        lines = r.aiter_lines()
        first = None
        async for line in lines:
            if line.startswith("data: "):
                first = line
                break
        if first is None:
            tally.errors.append("abort: no first chunk")
            return
        a = await client.post("/abort_request", json={"rid": rid})
        if a.status_code != 200:
            tally.errors.append(f"abort_request: {a.status_code}")
        chunks, done = _data_lines([first] + [line async for line in lines])
    if not done:
        tally.errors.append("abort: no [DONE]")
        return
    reason = chunks[-1]["meta_info"]["finish_reason"] if chunks else None
    # A request can finish on its own between the first chunk and the abort (128 tokens is short).
    if reason is None or reason.get("type") not in ("abort", "length"):
        tally.errors.append(f"abort: finish_reason {reason}")


async def _json(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"text": "Record: " + _prompt(rng),
            "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "json_schema": json.dumps(SCHEMA)}}
    r = await client.post("/generate", json=body)
    if r.status_code != 200:
        tally.errors.append(f"json: {r.status_code} {r.text[:200]}")
        return
    out = r.json()
    if out["meta_info"]["finish_reason"]["type"] != "stop":
        return  # cut by max_new_tokens: not a finished answer
    import jsonschema

    tally.constrained_checked += 1
    try:
        jsonschema.validate(json.loads(out["text"], strict=True), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        tally.invalid_json.append(f"{out['text']!r}: {e}"[:300])


async def _client(base_url: str, index: int, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + index)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        k = 0
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, weights=(25, 20, 15, 10, 10, 20))[0]
            tally.requests[kind] += 1
            k += 1
            try:
                if kind == "generate":
                    await _generate(client, rng, tally, stream=False)
                elif kind == "generate_stream":
                    await _generate(client, rng, tally, stream=True)
                elif kind == "chat_stream":
                    await _chat_stream(client, rng, tally)
                elif kind == "disconnect":
                    await _disconnect(client, rng, tally)
                elif kind == "abort":
                    await _abort(client, rng, tally, rid=f"soak-{seed}-{index}-{k}")
                else:
                    await _json(client, rng, tally)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                tally.errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])


def _leaks(base_url: str, idle_timeout_s: float) -> dict[str, Any]:
    """Wait for the server to go idle, flush the prefix cache, and count pages and slots still in use."""
    deadline = time.monotonic() + idle_timeout_s
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = httpx.get(base_url + "/get_server_info", timeout=30).json()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        time.sleep(0.2)
    else:
        return {"leaked_pages": -1, "leaked_slots": -1, "idle": False}
    flushed = httpx.post(base_url + "/flush_cache", timeout=60).status_code == 200
    memory = httpx.get(base_url + "/get_server_info", timeout=30).json()["memory"]
    return {"idle": True, "flushed": flushed,
            "leaked_pages": memory["kv_pages_total"] - memory["kv_pages_free"],
            "leaked_slots": memory["gdn_slots_total"] - memory["gdn_slots_free"]}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; returns the exit status (0: no error, no leak, no invalid constrained answer)."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of traffic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to drain")
    args = p.parse_args(argv)
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.duration

    async def all_clients() -> None:
        await asyncio.gather(*(_client(args.base_url, i, deadline, args.seed, tally) for i in range(args.clients)))

    asyncio.run(all_clients())
    wall = time.monotonic() - t0
    leaks = _leaks(args.base_url, args.idle_timeout)
    report = {
        "clients": args.clients, "wall_s": round(wall, 1), "requests": sum(tally.requests.values()),
        "by_kind": dict(tally.requests), "errors": len(tally.errors), "constrained_checked": tally.constrained_checked,
        "invalid_constrained": len(tally.invalid_json), **leaks,
        "first_errors": tally.errors[:5], "first_invalid": tally.invalid_json[:5],
    }
    print(json.dumps(report, indent=1))
    bad = report["errors"] or report["invalid_constrained"] or leaks["leaked_pages"] or leaks["leaked_slots"]
    return 1 if bad or not leaks.get("idle") else 0


if __name__ == "__main__":
    sys.exit(main())
