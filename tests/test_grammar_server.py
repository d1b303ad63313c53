"""Constrained decoding over HTTP: native sampling_params, OpenAI response_format and SGLang's regex/ebnf
extras through the official client, and grammar errors as 400s that leave the server serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

REGEX = r"(red|green|blue) [0-9]{1,3}"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a color as JSON."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def test_native_generate_regex_and_stream(server) -> None:
    body = {"text": "Color:", "sampling_params": {"temperature": 0, "regex": REGEX, "max_new_tokens": 16}}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert re.fullmatch(REGEX, r.json()["text"])
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["text"] == r.json()["text"]  # streamed, the same constrained greedy text


def test_grammar_wins_over_min_new_tokens(server) -> None:
    # After "yes" the regex allows only EOS, which min_new_tokens bans: the grammar wins and the request
    # stops there, mixed in one batch with an unconstrained row whose EOS stays banned.
    body = {"text": ["Answer:", "Answer:"], "sampling_params": [
        {"temperature": 0, "regex": "yes", "max_new_tokens": 12, "min_new_tokens": 8},
        {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8}]}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    constrained, free = r.json()
    assert constrained["text"] == "yes" and constrained["meta_info"]["finish_reason"]["type"] == "stop"
    assert free["meta_info"]["completion_tokens"] == 8


def test_openai_response_format_json_schema(client, server) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=0,
                                           response_format=rf)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=1.0,
                                            seed=7, response_format=rf, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # json_object: any object. A random model rarely closes a free-form key within the budget, so "}" is biased
    # up: unconstrained, the reply would open with "}" and not parse; under the grammar it must be an object.
    (close,) = server.engine.tokenizer.encode("}")
    obj = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=0,
                                         response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_openai_sglang_extra_regex_and_ebnf(client) -> None:
    reply = client.completions.create(model="default", prompt="Color:", max_tokens=16, temperature=0,
                                      extra_body={"regex": REGEX})
    assert re.fullmatch(REGEX, reply.choices[0].text)
    chat = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=16, temperature=0,
                                          extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert chat.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("path, body, message", [
    ("/generate", {"text": "x", "sampling_params": {"regex": "[a-"}}, "invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "foo"}'}}, 'Unsupported type "foo"'),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= ("}}, "EBNF parser error"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "only one constraint"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 'Unsupported type "foo"'),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "response_format": {"type": "json_object"}},
     "only one constraint"),
    ("/v1/completions", {"prompt": "x", "regex": "(a"}, "invalid regex"),
])
def test_bad_grammar_is_400_and_server_stays_up(server, path, body, message) -> None:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    reply = r.json()  # native routes: {"error": {"message"}}; OpenAI routes: {"message", "type", ...}
    assert message in (reply["error"]["message"] if "error" in reply else reply["message"]), reply
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    ok = httpx.post(server.url + "/generate", timeout=300,
                    json={"text": "x", "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) >= 1


def test_bench_serving_json_schema_workload(server) -> None:
    """`bench_serving --json-schema`: every request is constrained to the built-in records schema, which is
    longer than the output length, so each request still streams exactly its output length."""
    from sglang_tpu_qwen.bench.serving import RECORDS_SCHEMA, build_sessions, main, parse_args

    argv = ["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "16",
            "--random-output-len", "12", "--json-schema", "--seed", "3", "--disable-tqdm"]
    assert parse_args(argv).schema == RECORDS_SCHEMA
    assert parse_args([*argv[:-4], "--json-schema", '{"type": "integer"}']).schema == {"type": "integer"}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_args(["--json-schema", "{oops"])
    m = main(argv)
    assert (m["completed"], m["failed"], m["json_schema"]) == (2, 0, True)
    assert m["total_output_tokens"] == sum(s[0].output_len for s in build_sessions(parse_args(argv)))
    # What the constraint produced: the start of a records document, token for token the greedy reply.
    body = {"input_ids": build_sessions(parse_args(argv))[0][0].new_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "json_schema": json.dumps(RECORDS_SCHEMA)}}
    text = httpx.post(server.url + "/generate", json=body, timeout=300).json()["text"]
    assert text.startswith('{"records": [{"id": ')
