"""Streamed text over the real server never stalls and adds up (SGLang #34740, fix #34852).

Tokens are forced with logit_bias (+100) through the real engine and HTTP routes: lone UTF-8 bytes (a
continuation byte with no lead decodes to U+FFFD forever, lead bytes may or may not complete) and 200 random
tokens. On every streaming route the text sent so far only grows, it grows in most chunks, and the joined
stream equals the non-streamed text and decode(output_ids).

The module serves its own engine: the session one's with a 2,048-token KV pool instead of XLA:CPU's default
65,536 (engine/runner/memory_split.py). A decode step's cost on CPU grows with the pool (100 greedy tokens: 6.1 s
against 0.8 s at 1,024), and these tests decode about 1,800 tokens; what they check does not depend on the pool.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ENGINE_KWARGS, LiveServer, serve_app

ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """The session server's engine settings with a small KV pool (4 requests x 256 tokens, twice over)."""
    from sglang_tpu_qwen.engine.engine import Engine
    from sglang_tpu_qwen.server.app import create_app

    engine = Engine(**{**ENGINE_KWARGS, "max_total_tokens": 2048})
    try:
        with serve_app(create_app(engine)) as url:
            yield LiveServer(url=url, engine=engine)
    finally:
        engine.shutdown()


def _byte_ids(tok, byte_values) -> list[int]:
    wanted = {bytes([b]) for b in byte_values}
    return [i for i in range(512) if tok.token_bytes(i) in wanted]


def _body(route: str, bias: dict[int, float], n_tokens: int, stream: bool, temperature: float) -> dict:
    common = {"max_tokens": n_tokens, "temperature": temperature, "seed": 5, "stream": stream,
              "logit_bias": {str(k): v for k, v in bias.items()}, "ignore_eos": True}
    if route == "/generate":
        params = {"max_new_tokens": n_tokens, "temperature": temperature, "logit_bias": common["logit_bias"],
                  "ignore_eos": True, "seed": 5}
        return {"text": "Bytes:", "sampling_params": params, "stream": stream}
    if route == "/v1/completions":
        return {"model": "default", "prompt": "Bytes:", **common}
    return {"model": "default", "messages": [{"role": "user", "content": "Bytes:"}],
            "chat_template_kwargs": {"enable_thinking": False}, "separate_reasoning": False, **common}


def _stream_texts(url: str, route: str, body: dict) -> list[str]:
    """The text each chunk adds (for /generate: the cumulative text's new part, checked to be a prefix)."""
    added: list[str] = []
    sent = ""
    with httpx.stream("POST", url + route, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if route == "/generate":
                assert chunk["text"].startswith(sent), "the text sent so far shrank or changed"
                added.append(chunk["text"][len(sent):])
                sent = chunk["text"]
            elif route == "/v1/completions":
                added.extend(c["text"] for c in chunk["choices"])
            else:
                added.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return added


def _final(url: str, route: str, body: dict) -> tuple[str, list[int] | None]:
    r = httpx.post(url + route, json={**body, "stream": False}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    if route == "/generate":
        return out["text"], out["output_ids"]
    if route == "/v1/completions":
        return out["choices"][0]["text"], None
    return out["choices"][0]["message"]["content"], None


@pytest.mark.parametrize("route", ROUTES)
def test_lone_byte_stream_grows_and_adds_up(server, route):
    tok = server.engine.tokenizer
    lone = _byte_ids(tok, [0x80])  # never completes: U+FFFD on its own
    added = _stream_texts(server.url, route, _body(route, {lone[0]: 100.0}, 40, True, 0.0))
    grew = sum(1 for a in added if a)
    assert grew >= 0.8 * 40, f"only {grew} of {len(added)} chunks carried text"
    final, ids = _final(server.url, route, _body(route, {lone[0]: 100.0}, 40, False, 0.0))
    assert "".join(added) == final == "\ufffd" * 40
    if ids is not None:
        assert final == tok.decode(ids)


@pytest.mark.parametrize("route", ROUTES)
def test_mixed_bytes_and_random_tokens_add_up(server, route):
    """Lead, continuation and ASCII bytes at temperature 1 (characters that complete, break, or never end),
    then 200 random tokens: joined stream == non-streamed text == decode(output_ids)."""
    tok = server.engine.tokenizer
    mixed = _byte_ids(tok, [0xE4, 0xB8, 0xAD, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80, 0x41])
    rng = random.Random(3)
    special = set(tok.special_token_ids)
    pool = [i for i in rng.sample(range(tok.vocab_size), 400) if i not in special][:250]
    for bias, n in (({i: 100.0 for i in mixed}, 60), ({i: 100.0 for i in pool}, 200)):
        stream_body = _body(route, bias, n, True, 1.0)
        added = _stream_texts(server.url, route, stream_body)
        final, ids = _final(server.url, route, stream_body)
        assert "".join(added) == final
        if ids is not None:
            assert len(ids) == n and final == tok.decode(ids)
