"""Request fields that change what the server does: continue_final_message and continuous_usage_stats.

Over the real server: the continued chat's prompt is the conversation with its final assistant message left
open (checked by token count and by the greedy continuation of that exact prompt through /generate), and a
stream with `stream_options.continuous_usage_stats` carries its choice's usage so far on every chunk.
"""

from __future__ import annotations

import json

import httpx
import pytest

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to five."},
    {"role": "assistant", "content": "One, two,"},
]
GREEDY = {"temperature": 0, "max_tokens": 6}


def _chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "default", **body}, timeout=300)


@pytest.mark.parametrize("thinking", [True, False])
def test_continue_final_message_renders_the_last_message_open(server, thinking):
    tok = server.engine.tokenizer
    # The template's rendering up to the final message's content: no <|im_end|>, no new assistant turn; the turn
    # in progress has Qwen3.5's (empty) think block, and the model continues after it.
    open_prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCount to five.<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\nOne, two,")
    closed = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, enable_thinking=thinking)
    assert closed.startswith(open_prompt.replace("<think>\n\n</think>\n\n", ""))
    body = {"messages": CONVERSATION, "continue_final_message": True, **GREEDY,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    r = _chat(server.url, body)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tok.encode(open_prompt)
    assert out["usage"]["prompt_tokens"] == len(ids)
    ref = httpx.post(server.url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
    message = out["choices"][0]["message"]
    assert (message.get("reasoning_content") or "") + (message["content"] or "") == ref["text"]
    # Without the flag the same messages get a new assistant turn: a different, longer prompt.
    plain = _chat(server.url, {"messages": CONVERSATION, **GREEDY,
                                "chat_template_kwargs": {"enable_thinking": thinking}}).json()
    assert plain["usage"]["prompt_tokens"] > len(ids)


def test_continue_final_message_with_generation_prompt_is_a_400(server):
    r = _chat(server.url, {"messages": CONVERSATION, "continue_final_message": True, "add_generation_prompt": True,
                           **GREEDY})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["message"]
    r = _chat(server.url, {"messages": CONVERSATION[:2], "continue_final_message": True, **GREEDY})
    assert r.status_code == 400 and "assistant" in r.json()["message"]
    # add_generation_prompt false alone: the conversation as it is, closed.
    r = _chat(server.url, {"messages": CONVERSATION, "add_generation_prompt": False, **GREEDY})
    closed = server.engine.tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(server.engine.tokenizer.encode(closed))


def _chunks(url: str, route: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", url + route, json={"model": "default", **body}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line and line != "data: [DONE]":
                out.append(json.loads(line[len("data: "):]))
    return out


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_on_every_chunk(server, route, n):
    prompt = {"prompt": "Once upon a time"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Once upon a time"}]}
    body = {**prompt, "max_tokens": 5, "temperature": 0.8, "seed": 1, "n": n, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(server.url, route, body)
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * n
    prompt_tokens = final["usage"]["prompt_tokens"]  # counted once per prompt
    seen = {i: 0 for i in range(n)}
    for c in choice_chunks:
        (choice,) = c["choices"]
        usage = c["usage"]
        assert usage is not None and usage["prompt_tokens"] == prompt_tokens
        # Its choice's completion tokens so far: never decreasing, reaching 5 by the finishing chunk.
        assert usage["completion_tokens"] >= seen[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[choice["index"]] = usage["completion_tokens"]
        if choice.get("finish_reason"):
            assert usage["completion_tokens"] == 5
    assert seen == {i: 5 for i in range(n)}
    # Without the flag only the last chunk has usage.
    body["stream_options"] = {"include_usage": True}
    assert all(c.get("usage") is None for c in _chunks(server.url, route, body)[:-1])
