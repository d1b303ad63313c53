"""OpenAI chat with `--reasoning-parser qwen3 --tool-call-parser qwen3_coder`, through the `openai` client.

The embedded model has random weights, so its outputs are forced where a test needs a known shape: a
`regex` extra field for the reasoning split, the tool_choice grammar for tool calls. Served by a second
app over the session engine (no second Engine).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import serve_app

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Set the mode."}]
TOOL_MESSAGES = [{"role": "user", "content": "Mode?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Small schemas: the session engine has a 256-token context, and the random model spells a forced call
# out in ~90 mostly one-character tokens.
TOOLS = [
    {"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "required": ["mode", "on"],
        "properties": {"mode": {"enum": ["eco", "max"]}, "on": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_state", "parameters": {
        "type": "object", "required": ["all"], "properties": {"all": {"type": "boolean"}}}}},
]
CALL_BUDGET = 110  # max_tokens of a forced call


@pytest.fixture(scope="module")
def parsed_url(engine):
    from sglang_tpu_qwen.server.app import create_app

    with serve_app(create_app(engine, reasoning_parser="qwen3", tool_call_parser="qwen3_coder")) as url:
        yield url


@pytest.fixture(scope="module")
def client(parsed_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=parsed_url + "/v1", api_key="unused", timeout=300)


def chat(client, stream=False, **kw):
    args = dict(model="default", messages=MESSAGES, temperature=0, max_tokens=48)
    args.update(kw)
    if stream:
        return collect(client.chat.completions.create(stream=True, **args))
    return client.chat.completions.create(**args)


def whole_and_streamed(client, **kw):
    """The same greedy request non-streamed and streamed, sent together so the engine batches them."""
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(chat, client, **kw)
        streamed = pool.submit(chat, client, stream=True, **kw)
        return whole.result(), streamed.result()


def collect(chunks) -> dict:
    """A streamed choice 0 put back together: reasoning, content, tool calls, logprob tokens, finish."""
    out = {"reasoning": "", "content": "", "calls": {}, "tokens": [], "finish": None, "first_call_deltas": {}}
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        out["reasoning"] += getattr(d, "reasoning_content", None) or ""
        out["content"] += d.content or ""
        for tc in d.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.index not in out["first_call_deltas"]:
                out["first_call_deltas"][tc.index] = tc
            call["id"] = call["id"] or tc.id
            call["name"] = call["name"] or tc.function.name
            call["arguments"] += tc.function.arguments or ""
        if ch.logprobs is not None:
            out["tokens"] += [t.token for t in ch.logprobs.content]
        if ch.finish_reason:
            assert out["finish"] is None
            out["finish"] = ch.finish_reason
    return out


# With thinking on, a constraint applies only after </think> (SGLang's require_reasoning), which the random
# model never writes; with thinking off it applies from the first token, and a `<think>` the output opens
# itself starts the reasoning, so these tests force both sides that way.
FORCED_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_reasoning_split_forced_by_regex(client):
    # "a <b" makes the parser hold "<" back (it may start </think>): its token's logprob must still come.
    resp, streamed = whole_and_streamed(client, logprobs=True, top_logprobs=1,
                                        extra_body={"regex": "<think>a <b</think>cd", **FORCED_THINK})
    msg, choice = resp.choices[0].message, resp.choices[0]
    assert (msg.reasoning_content, msg.content) == ("a <b", "cd")
    assert choice.finish_reason == "stop"
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == resp.usage.completion_tokens
    assert (streamed["reasoning"], streamed["content"]) == ("a <b", "cd")
    assert streamed["tokens"] == tokens  # each token's logprob exactly once, in order
    assert streamed["finish"] == "stop"


def test_reasoning_off_forced_by_regex(client):
    resp, streamed = whole_and_streamed(client, extra_body={"regex": "plain answer", **NO_THINKING})
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.content) == (None, "plain answer")
    assert (streamed["reasoning"], streamed["content"]) == ("", "plain answer")


def test_forced_named_tool_call(client):
    named = {"type": "function", "function": {"name": "set_mode"}}
    resp, streamed = whole_and_streamed(client, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=named,
                                        max_tokens=CALL_BUDGET, extra_body=NO_THINKING)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "set_mode"
    args = json.loads(call.function.arguments)
    assert set(args) == {"mode", "on"}
    assert args["mode"] in ("eco", "max") and isinstance(args["on"], bool)

    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    first = streamed["first_call_deltas"][0]
    assert first.id.startswith("call_") and first.function.name == "set_mode" and first.type == "function"
    assert list(streamed["calls"]) == [0]
    assert streamed["calls"][0]["arguments"] == call.function.arguments  # greedy: same call, same text


def test_required_tool_choice(client, server):
    # Two functions without parameters keep the prompt and the forced call short. The server without
    # --tool-call-parser parses a forced call too: the grammar fixed its format.
    tools = [{"type": "function", "function": {"name": name}} for name in ("lamp_on", "lamp_off")]
    kw = dict(messages=TOOL_MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,
              max_tokens=CALL_BUDGET, extra_body=NO_THINKING)
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)
    with ThreadPoolExecutor(2) as pool:
        replies = [f.result() for f in [pool.submit(chat, client, **kw), pool.submit(chat, plain, **kw)]]
    for resp in replies:
        assert resp.choices[0].finish_reason == "tool_calls"
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name in ("lamp_on", "lamp_off") and json.loads(call.function.arguments) == {}
    assert replies[0].choices[0].message.tool_calls[0].function.name == \
        replies[1].choices[0].message.tool_calls[0].function.name


def test_tool_choice_auto_parses_and_none_does_not(client):
    # The same call text, forced by a regex: parsed into tool_calls under "auto", plain content under "none".
    call = "<tool_call>\n<function=get_state>\n<parameter=all>\ntrue\n</parameter>\n</function>\n</tool_call>"
    kw = dict(messages=TOOL_MESSAGES, tools=TOOLS[1:], max_tokens=CALL_BUDGET,
              extra_body={"regex": call, **NO_THINKING})
    with ThreadPoolExecutor(2) as pool:
        auto = pool.submit(chat, client, **kw)
        none = pool.submit(chat, client, tool_choice="none", **kw)
        auto, none = auto.result().choices[0], none.result().choices[0]
    (parsed,) = auto.message.tool_calls
    assert (parsed.function.name, json.loads(parsed.function.arguments)) == ("get_state", {"all": True})
    assert auto.finish_reason == "tool_calls" and auto.message.content == ""
    assert none.message.tool_calls is None and none.message.content == call and none.finish_reason == "stop"


def test_stream_agrees_with_non_stream(client):
    whole, streamed = whole_and_streamed(client, messages=TOOL_MESSAGES, tools=TOOLS, max_tokens=24, logprobs=True)
    whole = whole.choices[0]
    assert streamed["reasoning"] == (whole.message.reasoning_content or "")
    assert streamed["content"] == (whole.message.content or "")
    calls = whole.message.tool_calls or []
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert streamed["tokens"] == [t.token for t in whole.logprobs.content]
    assert streamed["finish"] == whole.finish_reason


def test_logprobs_once_when_a_stop_string_holds_text(client, parsed_url):
    # The stop string "yy q" never completes, but its prefix "yy" is held back for a while.
    body = {"regex": "xx yy zz"}
    resp, streamed = whole_and_streamed(client, stop=["yy q"], logprobs=True,
                                        extra_body={"regex": "<think>xx yy zz", **FORCED_THINK})
    assert streamed["reasoning"] == resp.choices[0].message.reasoning_content == "xx yy zz"
    assert streamed["tokens"] == [t.token for t in resp.choices[0].logprobs.content]
    assert len(streamed["tokens"]) == resp.usage.completion_tokens
    # Completions route, same rule.
    comp = openai.OpenAI(base_url=parsed_url + "/v1", api_key="unused", timeout=300).completions
    kw = dict(model="default", prompt="Say:", temperature=0, max_tokens=16, stop=["yy q"], logprobs=1,
              extra_body=body)
    with ThreadPoolExecutor(2) as pool:
        full_f = pool.submit(comp.create, **kw)
        chunks = list(pool.submit(comp.create, stream=True, **kw).result())
        full = full_f.result()
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text == "xx yy zz"
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == full.choices[0].logprobs.tokens
    assert len(full.choices[0].logprobs.tokens) == full.usage.completion_tokens


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], "System message must be"),
    ([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
     "System message must be"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "set_mode", "arguments": "{not json"}}]}],
     "must be a JSON object"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "set_mode", "arguments": "[1]"}}]}],
     "must be a JSON object"),
])
def test_bad_conversations_are_400(parsed_url, messages, fragment):
    r = httpx.post(parsed_url + "/v1/chat/completions", timeout=60,
                   json={"model": "default", "messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "requires tools"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "cannot be combined"),
])
def test_bad_tool_choice_is_400(parsed_url, body, fragment):
    r = httpx.post(parsed_url + "/v1/chat/completions", timeout=60,
                   json={"model": "default", "messages": MESSAGES, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["message"]


def test_agent_history_roundtrip(parsed_url):
    """An agent history as OpenAI clients send it: JSON-string arguments, tool results, multi-part text,
    a developer message; answered with 200."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Mode?"}, {"type": "text", "text": "Now."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_state", "arguments": '{"all": true}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "set_mode", "arguments": {"mode": "eco", "on": True}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "eco"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "ok"}]},
    ]
    r = httpx.post(parsed_url + "/v1/chat/completions", timeout=120,
                   json={"model": "default", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
