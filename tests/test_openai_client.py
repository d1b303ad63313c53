"""OpenAI routes through the official `openai` client, checked against /generate on the same Engine."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def chat_reference(server) -> dict:
    """Greedy /generate reply for MESSAGES rendered with the model's chat template."""
    prompt = server.engine.tokenizer.apply_chat_template(MESSAGES, tools=None, add_generation_prompt=True)
    r = httpx.post(server.url + "/generate", timeout=300,
                   json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    return {"prompt_tokens": len(server.engine.tokenizer.encode(prompt)), **r.json()}


def test_models(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.engine.served_model_name]


def test_chat_completion(client, server, chat_reference):
    resp = client.chat.completions.create(model=server.engine.served_model_name, messages=MESSAGES,
                                          temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == chat_reference["text"]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == chat_reference["prompt_tokens"]
    assert resp.usage.completion_tokens == 4
    assert resp.usage.total_tokens == chat_reference["prompt_tokens"] + 4
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    content = choice.logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert 1 <= len(entry.top_logprobs) <= 2
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)


def test_chat_completion_stream(client, chat_reference):
    stream = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0,
                                            max_completion_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == chat_reference["prompt_tokens"]


def test_completion(client, server):
    prompt = "The capital of France is"
    ref = httpx.post(server.url + "/generate", timeout=300,
                     json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                           "return_logprob": True, "return_text_in_logprobs": True}).json()
    resp = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=4, logprobs=1)
    choice = resp.choices[0]
    assert resp.object == "text_completion"
    assert choice.text == ref["text"]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert lp.tokens == [text for _, _, text in ref["meta_info"]["output_token_logprobs"]]  # each token's own text
    assert lp.token_logprobs == pytest.approx([lp_ for lp_, _, _ in ref["meta_info"]["output_token_logprobs"]],
                                              abs=1e-5)
    assert lp.text_offset[0] == 0
    assert all(len(top) == 1 for top in lp.top_logprobs)
