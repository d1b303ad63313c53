"""64 concurrent HTTP requests of mixed lengths: all finish, each equals its solo run, all memory returns."""

from __future__ import annotations

import asyncio
import json
import random

import httpx


def _bodies(vocab_hi: int) -> list[dict]:
    rng = random.Random(7)
    bodies = []
    for i in range(64):
        prompt_len = rng.choice([1, 3, 17, 40, 90, 150])
        body = {
            "input_ids": [rng.randrange(0, vocab_hi) for _ in range(prompt_len)],
            "sampling_params": {"temperature": 0, "max_new_tokens": rng.choice([1, 4, 9, 16]), "ignore_eos": True},
            "stream": i % 4 == 0,
        }
        if i % 5 == 0:
            body["return_logprob"] = True
        bodies.append(body)
    return bodies


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    if not body["stream"]:
        r = await client.post(url + "/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    last, logprobs = None, []
    async with client.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: "):])
                logprobs += last["meta_info"].get("output_token_logprobs", [])  # per-chunk lists (SGLang)
    assert last is not None
    if "output_token_logprobs" in last["meta_info"]:
        assert last["meta_info"]["output_token_logprobs_length"] == len(logprobs)
        last["meta_info"]["output_token_logprobs"] = logprobs
    return last


def test_64_concurrent_requests_free_all_memory(server):
    bodies = _bodies(vocab_hi=248000)

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=900) as client:
            return await asyncio.gather(*[_send(client, server.url, b) for b in bodies])

    outs = asyncio.run(run_all())
    for body, out in zip(bodies, outs, strict=True):
        want = body["sampling_params"]["max_new_tokens"]
        assert len(out["output_ids"]) == want
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": want}
        assert out["meta_info"]["prompt_tokens"] == len(body["input_ids"])
        if body.get("return_logprob"):
            assert [t[1] for t in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]

    # Batching must not change greedy tokens: spot-check a few against solo requests.
    for k in (0, 13, 41):
        solo = httpx.post(server.url + "/generate", json={**bodies[k], "stream": False}, timeout=300).json()
        assert solo["output_ids"] == outs[k]["output_ids"]

    # Idle now: flushing the prefix cache must hand every page and snapshot back.
    assert httpx.post(server.url + "/flush_cache", timeout=60).status_code == 200
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    mem = info["memory"]
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert mem["kv_pages_free"] == mem["kv_pages_total"] > 0
    assert mem["gdn_slots_free"] == mem["gdn_slots_total"] > 0
    assert mem["snapshot_slots_free"] == mem["snapshot_slots_total"] > 0
    assert mem["cached_pages"] == 0 and mem["cached_snapshots"] == 0
    # The GDN snapshot host tier is on with default flags, and empty once flushed.
    assert info["gdn_snapshot_host_tier"]["rule"] == "default" and mem["host_snapshot_budget_bytes"] > 0
    assert mem["host_snapshots"] == mem["host_snapshot_bytes"] == mem["host_snapshots_pending"] == 0
