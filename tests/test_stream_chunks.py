"""Streaming from increments (server/sse.py): the wire format is SGLang's, and a long stream's chunks add up.

The engine hands the HTTP layer only what is new in each chunk; /generate still sends cumulative text and
output_ids (built from encoded bytes, `NativeChunks`), the OpenAI routes deltas. A 1,000-token stream over a
real server on loopback: the native chunks grow by prefix to the final text, the completion chunks join to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ENGINE_KWARGS, serve_app

from sglang_tpu_qwen.server.sse import NativeChunks, sse

# Past the session server's 256-token context, so the reply is long and crosses many KV pages. No check here
# measures time or bytes, so a longer reply would not catch a chunk cost that grows with the reply (a quadratic
# stream) either; it only made the test 4x slower (two streams at ~23 ms a token on CPU: 181 s against 55 s).
LONG = 1000


def _increment(index: int, text: str, ids: list[int], logprobs: bool, total: int) -> dict:
    meta: dict[str, Any] = {"id": f"r{index}", "prompt_tokens": 3, "completion_tokens": total, "cached_tokens": 0,
                            "finish_reason": None, "e2e_latency": 0.5}
    if logprobs:
        meta["input_token_logprobs"] = [[None, 1, "a"]]
        meta["output_token_logprobs"] = [[-0.5, t, "x"] for t in ids]
    return {"text": text, "output_ids": ids, "meta_info": meta, "index": index}


@pytest.mark.parametrize("logprobs", [False, True])
def test_native_chunks_are_json_dumps_of_the_cumulative_reply(logprobs):
    """The spliced bytes equal json.dumps of SGLang's cumulative chunk, for text JSON must escape."""
    pieces = ["", 'a "quoted"', " back\\slash", "\nnew\tline\x01", "", "ünï 中文 🙂", "</s>"]
    render, incremental = NativeChunks(incremental=False), NativeChunks(incremental=True)
    text: dict[int, str] = {0: "", 1: ""}
    ids: dict[int, list[int]] = {0: [], 1: []}
    for k, piece in enumerate(pieces):
        index = k % 2  # two batch members, interleaved
        new_ids = [k, 100 + k] if piece else []
        text[index] += piece
        ids[index] += new_ids
        inc = _increment(index, piece, new_ids, logprobs, len(ids[index]))
        meta = dict(inc["meta_info"])
        if logprobs:
            meta["output_token_logprobs_length"] = len(ids[index])
        expected = {"text": text[index], "output_ids": ids[index], "meta_info": meta, "index": index}
        assert render(_increment(index, piece, new_ids, logprobs, len(ids[index]))) == [sse(expected)]
        delta = {**expected, "text": piece, "output_ids": new_ids}
        assert incremental(_increment(index, piece, new_ids, logprobs, len(ids[index]))) == [sse(delta)]


@pytest.fixture(scope="module")
def long_server() -> Iterator[Any]:
    """A server whose context fits a LONG-token reply (the session server's holds 256 tokens)."""
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.server.app import create_app

    engine = Engine(**{**ENGINE_KWARGS, "context_length": LONG + 64, "max_total_tokens": LONG + 256,
                       "max_running_requests": 1})
    try:
        with serve_app(create_app(engine)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _events(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=1800) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_long_stream_chunks_add_up_to_the_final_text(long_server):
    url, engine = long_server
    prompt = "Count the stars:"
    native = _events(url + "/generate", {"text": prompt, "stream": True, "return_logprob": True,
                                         "sampling_params": {"temperature": 0, "max_new_tokens": LONG,
                                                             "ignore_eos": True}})
    assert len(native) == LONG  # stream_interval 1: one chunk per token
    for prev, nxt in zip(native, native[1:], strict=False):  # cumulative text and ids, as SGLang sends them
        assert nxt["text"].startswith(prev["text"]) and nxt["output_ids"][:-1] == prev["output_ids"]
    final = native[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert len(final["output_ids"]) == LONG
    assert final["text"] == engine.tokenizer.decode(final["output_ids"], True)
    # Logprobs: each chunk carries its new tokens' only; the length field counts all so far.
    lps = [lp for c in native for lp in c["meta_info"]["output_token_logprobs"]]
    assert [lp[1] for lp in lps] == final["output_ids"]
    assert [c["meta_info"]["output_token_logprobs_length"] for c in native] == list(range(1, LONG + 1))

    chunks = _events(url + "/v1/completions", {"model": "default", "prompt": prompt, "stream": True,
                                               "temperature": 0, "max_tokens": LONG, "ignore_eos": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == final["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
