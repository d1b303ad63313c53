"""Real SGLang frontend programs (`sgl.function` + `sgl.RuntimeEndpoint`, sglang==0.5.23) against our server.

Served over the session engine behind a proxy that records every `async_generate` call, so the tests also
check what the frontend sent (e.g. `select`'s scoring batch). The app requires an api key, which the
frontend passes along.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import sglang as sgl  # the real frontend: requirements/frontend.txt (see README)
from conftest import serve_app

API_KEY = "sk-frontend"


class RecordingEngine:
    """The engine, with a log of the keyword arguments of every generation call."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def async_generate(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self._engine.async_generate(**kwargs)


@pytest.fixture(scope="module")
def frontend(engine):
    from sglang_tpu_qwen.server.app import create_app

    recorder = RecordingEngine(engine)
    with serve_app(create_app(recorder, api_key=API_KEY)) as url:
        yield sgl.RuntimeEndpoint(url, api_key=API_KEY), recorder, url


def test_model_info_selects_chatml_and_api_key(frontend):
    backend, _, url = frontend
    assert re.search(r"qwen.*(chat|instruct)", backend.get_model_name(), re.IGNORECASE)
    assert backend.get_chat_template().name == "qwen"
    with pytest.raises(RuntimeError, match="Unauthorized"):
        sgl.RuntimeEndpoint(url)  # no key: /get_model_info answers 401
    with pytest.raises(RuntimeError, match="Unauthorized"):
        sgl.RuntimeEndpoint(url, api_key="wrong")


def test_regex_gen(frontend):
    backend, _, _ = frontend

    @sgl.function
    def phone(s):
        s += "Call me at " + sgl.gen("number", regex=r"\(\d{3}\) \d{3}-\d{4}", max_tokens=24, temperature=0)

    state = phone.run(backend=backend)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", state["number"]), state["number"]
    assert state.get_meta_info("number")["finish_reason"]["type"] == "stop"


def test_json_schema_gen(frontend):
    backend, _, _ = frontend
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "admin"],
              "properties": {"name": {"type": "string", "enum": ["ann", "bob"]},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99},
                             "admin": {"type": "boolean"}}}

    @sgl.function
    def person(s):
        s += "A user as JSON: " + sgl.gen("user", json_schema=json.dumps(schema), max_tokens=64, temperature=0)

    value = json.loads(person.run(backend=backend)["user"])
    assert set(value) == {"name", "age", "admin"}
    assert value["name"] in ("ann", "bob") and isinstance(value["admin"], bool)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 99


def test_select_among_choices(frontend, engine):
    backend, recorder, _ = frontend
    choices = ["blue", "green", "red", "deep purple"]

    @sgl.function
    def sky(s):
        s += "The color of the sky is " + sgl.select("color", choices=choices)

    recorder.calls.clear()
    state = sky.run(backend=backend)
    meta = state.get_meta_info("color")
    assert state["color"] in choices
    # The frontend's decision is the argmax of the normalised logprobs it computed from our triples.
    assert state["color"] == choices[int(np.argmax(meta["normalized_prompt_logprobs"]))]
    for choice, triples in zip(choices, meta["input_token_logprobs"], strict=True):
        assert all(len(t) == 3 and isinstance(t[0], float) and t[0] <= 0.0 and isinstance(t[1], int)
                   and isinstance(t[2], str) for t in triples)
        assert "".join(t[2] for t in triples).endswith(choice)
    # What the server was sent: the prefix alone (to cache it and count its tokens), then one batch of
    # prefix + choice scored from two tokens before the prefix's end (the frontend's token healing).
    prefix = "The color of the sky is "
    cache_call, score_call = recorder.calls
    assert cache_call["text"] == prefix and cache_call["sampling_params"] == {"max_new_tokens": 0}
    assert score_call["text"] == [prefix + c for c in choices]
    assert score_call["sampling_params"] == {"max_new_tokens": 0, "temperature": 0}
    assert score_call["return_logprob"] is True and score_call["return_text_in_logprobs"] is True
    assert score_call["logprob_start_len"] == len(engine.tokenizer.encode(prefix)) - 2


def test_three_turn_chat(frontend):
    backend, recorder, _ = frontend

    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        for i, question in enumerate(["Hi!", "Name a color.", "Thanks."]):
            s += sgl.user(question)
            s += sgl.assistant(sgl.gen(f"answer{i}", max_tokens=4, temperature=0))

    recorder.calls.clear()
    state = chat.run(backend=backend)
    assert [m["role"] for m in state.messages()] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in state.messages()[1::2]] == ["Hi!", "Name a color.", "Thanks."]
    # ChatML, as the Qwen template renders it; each turn's prompt ends with an open assistant turn.
    assert state.text().startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n")
    prompts = [c["text"] for c in recorder.calls]
    assert len(prompts) == 3 and all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert prompts[2].startswith(prompts[1]) and prompts[1].startswith(prompts[0])
    for i in range(3):
        assert state.get_meta_info(f"answer{i}")["completion_tokens"] <= 4


def test_fork_three_branches(frontend, engine):
    backend, recorder, _ = frontend
    prefix = "Here is a long shared introduction that every branch reuses from the cache. " * 3

    @sgl.function
    def branches(s):
        s += prefix
        # fork() commits the prefix to the server (max_new_tokens 0) only if the executor thread has
        # already appended it; text() waits for that, so the branches can reuse it.
        assert s.text() == prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("out", max_tokens=5, temperature=0)
        forks.join()
        return [f["out"] for f in forks], [f.get_meta_info("out") for f in forks]

    backend.flush_cache()  # any hit below comes from this program's own committed prefix
    recorder.calls.clear()
    outs, metas = branches.run(backend=backend).ret_value
    assert len(outs) == 3
    for i, (out, meta) in enumerate(zip(outs, metas, strict=True)):
        ref = engine.generate(prefix + f"Branch {i}:", {"max_new_tokens": 5, "temperature": 0})
        assert out == ref["text"]  # greedy: a branch equals the same prompt sent alone
        assert meta["cached_tokens"] > 0  # the committed prefix is reused through the radix cache
    # fork() first commits the shared prefix (max_new_tokens 0), which the branches then hit.
    assert recorder.calls[0]["text"] == prefix and recorder.calls[0]["sampling_params"] == {"max_new_tokens": 0}


def test_streaming_gen(frontend):
    """A streamed program's pieces join to the non-streamed text. How many pieces `text_iter` yields is not
    asserted: its reader thread joins chunks that arrive before it wakes (see test_stream_logprobs_program);
    that the server streams chunk by chunk is checked there, on the wire."""
    backend, recorder, _ = frontend

    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, temperature=0)

    recorder.calls.clear()
    streamed = story.run(backend=backend, stream=True)
    pieces = list(streamed.text_iter("story"))
    assert [call.get("stream") for call in recorder.calls] == [True]  # the frontend asked for a stream
    whole = story.run(backend=backend)
    assert "".join(pieces) == whole["story"]
    assert whole.get_meta_info("story")["completion_tokens"] == 12


def test_stream_logprobs_program(frontend):
    """sglang 0.5.23's `test_programs.test_stream_logprobs`, without its client-side race.

    Upstream asserts that each chunk `text_async_iter` yields carries the logprobs of its new tokens only.
    That iterator runs on a second thread and reads the text and the latest meta_info when woken; two server
    chunks that arrive before it wakes come out as one chunk with the text of both and the logprobs of the
    second (seen in CI: completion_tokens 2, one logprob). So the per-chunk delta contract is checked here on
    the server's own event stream (every SSE event, no thread in between), and the frontend program on what
    coalescing cannot change: text, totals, and completion_tokens == output_token_logprobs_length per chunk.
    """
    import asyncio

    import httpx

    backend, recorder, url = frontend

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True))

    question = "Compose an engaging travel blog post about a recent trip to Hawaii."
    whole = qa.run(question=question, temperature=0, max_new_tokens=24, backend=backend)

    async def collect() -> list[tuple[str, dict]]:
        state = qa.run(question=question, stream=True, temperature=0, max_new_tokens=24, backend=backend)
        return [c async for c in state.text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert "".join(text for text, _ in chunks) == whole["answer"]
    for _, meta in chunks:
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
    assert chunks[-1][1]["completion_tokens"] == whole.get_meta_info("answer")["completion_tokens"]

    sent = recorder.calls[-1]["text"]  # the program's prompt, as the frontend sent it
    body = {"text": sent, "sampling_params": {"temperature": 0, "max_new_tokens": 24}, "return_logprob": True,
            "stream": True}
    events = []
    with httpx.stream("POST", url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:])["meta_info"])
    assert len(events) > 1
    done = 0
    for meta in events:
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - done  # this chunk's tokens only
        done = meta["completion_tokens"]
    streamed = [lp[1] for meta in events for lp in meta["output_token_logprobs"]]
    assert streamed == [lp[1] for lp in whole.get_meta_info("answer")["output_token_logprobs"]]


def test_incremental_streaming_output(server):
    """--incremental-streaming-output: text, output_ids and logprob lists are deltas; joined they equal the
    non-streamed reply."""
    import httpx

    body = {"text": "One two three", "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            "return_logprob": True}
    whole = httpx.post(server.url + "/generate", json=body, timeout=300).json()
    args = server.engine.server_args
    args.incremental_streaming_output = True
    try:
        chunks = []
        with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    finally:
        args.incremental_streaming_output = False
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
    assert [t[1] for t in lps] == whole["output_ids"]
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks][-1] == 6
    assert whole["meta_info"]["output_token_logprobs_length"] == 6


def test_stop_string(frontend, engine):
    backend, _, _ = frontend
    prompt = "Once upon a time"
    full = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})["text"]
    stop = full.strip()[3:6]  # a piece from the middle of the greedy continuation
    assert stop and stop in full

    @sgl.function
    def story(s):
        s += prompt + sgl.gen("story", max_tokens=12, stop=stop, temperature=0)

    state = story.run(backend=backend)
    assert state["story"] == full[: full.index(stop)]
    assert state.get_meta_info("story")["finish_reason"] == {"type": "stop", "matched": stop}


def test_min_and_max_tokens(frontend, engine):
    backend, _, _ = frontend
    prompt = "Count with me: one, two,"
    greedy = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    stop_id = greedy[1]  # greedy decoding would stop after two tokens on this id

    @sgl.function
    def count(s, min_tokens):
        s += prompt + sgl.gen("n", max_tokens=9, min_tokens=min_tokens, stop_token_ids=[stop_id], temperature=0)

    assert count.run(min_tokens=0, backend=backend).get_meta_info("n")["completion_tokens"] == 2
    meta = count.run(min_tokens=5, backend=backend).get_meta_info("n")
    assert 5 <= meta["completion_tokens"] <= 9

    @sgl.function
    def capped(s):
        s += prompt + sgl.gen("n", max_tokens=7, temperature=0)

    meta = capped.run(backend=backend).get_meta_info("n")
    assert meta["completion_tokens"] == 7 and meta["finish_reason"]["type"] == "length"


def test_cache_prefix_and_flush_cache(frontend):
    backend, _, _ = frontend
    prefix = "A system prompt long enough to fill more than one page of the prefix cache. " * 3
    backend.flush_cache()  # idle: 200 (the frontend raises on anything else)
    backend.cache_prefix(prefix)

    @sgl.function
    def ask(s):
        s += prefix + "Question:" + sgl.gen("a", max_tokens=2, temperature=0)

    assert ask.run(backend=backend).get_meta_info("a")["cached_tokens"] > 0
    backend.flush_cache()
    assert ask.run(backend=backend).get_meta_info("a")["cached_tokens"] == 0
