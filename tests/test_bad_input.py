"""Bad requests get a clear 4xx (SGLang's shapes) and leave the server serving normal requests."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _cases(vocab: int, ctx: int) -> list[tuple[str, object, int, str]]:
    """(path, body, status, message fragment). A bytes body is sent raw as JSON."""
    return [
        ("/generate", b"{not json", 400, "Invalid JSON"),
        (CHAT, b'{"messages": [', 400, "Invalid JSON"),
        ("/generate", {"text": ""}, 400, "empty"),
        ("/generate", {}, 400, "text or input_ids"),
        ("/generate", {"input_ids": [-1, 5]}, 400, "out of range"),
        ("/generate", {"input_ids": [vocab]}, 400, "out of range"),
        ("/generate", {"input_ids": [1] * (ctx + 1)}, 400, "context length"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": ctx + 1}}, 400, "context length"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, 400, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0.0}}, 400, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"no_such_param": 1}}, 400, "no_such_param"),
        ("/generate", {"text": "hi", "lora_path": "adapter"}, 400, "lora_path"),
        ("/generate", {"text": 5}, 400, "text"),
        (CHAT, {"model": "no-such-model", "messages": MSG}, 404, "The model no-such-model does not exist."),
        (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 2}, 400, "top_p"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"model": "default"}, 400, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
         "image_url"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "empty"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ]


def test_bad_inputs_then_normal_request(server):
    eng = server.engine
    failures = []
    for path, body, status, fragment in _cases(eng.model_config.vocab_size, eng.context_length):
        if isinstance(body, bytes):
            r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = httpx.post(server.url + path, json=body, timeout=60)
        reply = r.json()
        message = reply["message"] if "message" in reply else reply.get("error", {}).get("message", "")
        if r.status_code != status or fragment.lower() not in message.lower():
            failures.append((path, body, r.status_code, r.text))
        if path.startswith("/v1/") or r.status_code == 404 or "Invalid JSON" in fragment:
            assert reply.get("object") == "error" and reply.get("code") == r.status_code, r.text
    assert not failures, "\n".join(map(str, failures))
    ok = httpx.post(server.url + "/generate", timeout=300,
                    json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 1


def test_unknown_top_level_field_is_ignored_like_sglang(server):
    """SGLang parses /generate into a dataclass through FastAPI, which ignores unknown keys."""
    r = httpx.post(server.url + "/generate", timeout=300,
                   json={"text": "hi", "not_a_field": 1, "bootstrap_room": 7,
                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


def test_version_is_404(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 404


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_extra_fields_accepted(server, path):
    body = {"model": "default", "max_tokens": 1, "temperature": 0, "some_vendor_field": {"x": 1}}
    body.update({"messages": MSG} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
