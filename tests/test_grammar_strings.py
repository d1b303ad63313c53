"""Constrained JSON is JSON: no string value holds a raw control character (U+0000-U+001F), with either backend.

xgrammar 0.2.x lets raw control characters into strings bounded by minLength / maxLength and into patterns that
name one (grammar/json_strings.py); the server rewrites the first and refuses the second. Checked on the compiled
grammars byte by byte, and on 200 answers sampled at temperature 1 from the real server per backend: every
stop-finished answer passes `json.loads(strict=True)` and `jsonschema.validate`.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from sglang_tpu_qwen.grammar.backend import GrammarError
from sglang_tpu_qwen.grammar.manager import GrammarManager, load_backend, vocab_info
from sglang_tpu_qwen.grammar.spec import GrammarSpec

BACKENDS = ["xgrammar", "llguidance"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "code": {"type": "string", "pattern": "^[A-Za-z0-9 _.-]{1,5}$"},
        "kind": {"enum": ["plain", "tab\there", "quote\"d"]},
    },
    "required": ["name", "code", "kind"],
    "additionalProperties": False,
}
SAMPLES = 200


def _vocab(engine):
    cfg = engine.model_config
    return vocab_info(engine.tokenizer, cfg.vocab_size, set(cfg.eos_token_id) | set(engine.tokenizer.eos_token_ids))


@pytest.fixture(scope="module")
def backends(engine) -> dict:
    """Each backend loaded once for the module (llguidance takes seconds to load the vocabulary), with compact
    JSON as the session server's (the random-weight model would pad JSON with whitespace)."""
    vocab = _vocab(engine)
    return {name: load_backend(name, vocab, any_whitespace=False) for name in BACKENDS}


@pytest.fixture(scope="module")
def byte_ids(engine) -> dict[int, int]:
    tok = engine.tokenizer
    out: dict[int, int] = {}
    for i in range(1024):
        b = tok.token_bytes(i)
        if len(b) == 1:
            out.setdefault(b[0], i)
    assert len(out) == 256
    return out


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("sub", [{"type": "string"}, {"type": "string", "maxLength": 5},
                                 {"type": "string", "minLength": 1}, {"type": ["string", "null"], "maxLength": 4},
                                 {"maxLength": 4}, {"type": "string", "pattern": "^[^x]{0,9}$"},
                                 {"type": "string", "format": "date"}, {"enum": ["a\tb", "c"]}])
def test_no_raw_control_character_in_strings(backends, byte_ids, name, sub):
    backend = backends[name]
    schema = {"type": "object", "properties": {"s": sub}, "required": ["s"]}
    compiled = backend.compile(backend.prepare(GrammarSpec("json_schema", json.dumps(schema))))
    for control in range(0x20):
        for prefix in ('{"s":"', '{"s": "'):
            m = backend.matcher(compiled)
            ok = all(m.accept(byte_ids[b]) for b in prefix.encode())
            if ok:  # the string is open: a raw control character must be refused
                assert not m.accept(byte_ids[control]), (sub, control)
                break
        else:
            raise AssertionError(f"{name} accepts neither spacing of {schema}")


@pytest.mark.parametrize("name", BACKENDS)
def test_pattern_naming_a_control_character(backends, name):
    backend = backends[name]
    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^a\\tb$"}))
    if name == "xgrammar":  # it could only be met raw: refused with the keyword named
        with pytest.raises(GrammarError, match="'pattern'.*control character"):
            backend.prepare(spec)
    else:
        backend.compile(backend.prepare(spec))  # llguidance escapes it


@pytest.fixture(scope="module", params=BACKENDS)
def backend_server(request, server, backends):
    """The session server with its grammar manager on the given backend (one per backend for the module)."""
    engine = server.engine
    manager = GrammarManager(backends[request.param], _vocab(engine), any_whitespace=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "grammar", manager)
        yield server
    manager.shutdown()


def test_sampled_json_answers_parse_strictly_and_validate(backend_server):
    stopped = 0
    for batch in range(SAMPLES // 50):
        r = httpx.post(backend_server.url + "/generate", timeout=600, json={
            "text": ["Record:"] * 50,
            "sampling_params": [{"temperature": 1.0, "seed": 100 * batch + k, "max_new_tokens": 40,
                                 "json_schema": json.dumps(SCHEMA)} for k in range(50)]})
        assert r.status_code == 200, r.text
        for out in r.json():
            if out["meta_info"]["finish_reason"]["type"] != "stop":
                continue
            stopped += 1
            value = json.loads(out["text"], strict=True)
            jsonschema.validate(value, SCHEMA)
    assert stopped >= SAMPLES // 2, f"only {stopped} of {SAMPLES} answers finished"


@pytest.mark.parametrize("name", BACKENDS)
def test_structural_tag_strings_stay_clean(engine, backends, byte_ids, name):
    """The same inside a structural tag's JSON schema (llguidance wants its trigger to be a special token)."""
    backend = backends[name]
    begin = engine.tokenizer.token_to_id("<tool_call>")
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    tag = {"structures": [{"begin": "<tool_call>", "schema": schema, "end": "</tool_call>"}],
           "triggers": ["<tool_call>"]}
    compiled = backend.compile(backend.prepare(GrammarSpec("structural_tag", json.dumps(tag))))
    for prefix in ('{"s":"', '{"s": "'):
        m = backend.matcher(compiled)
        if m.accept(begin) and all(m.accept(byte_ids[b]) for b in prefix.encode()):
            assert not m.accept(byte_ids[0x09])
            m = backend.matcher(compiled)
            assert m.accept(begin) and all(m.accept(byte_ids[b]) for b in (prefix + 'ab"}').encode())
            break
    else:
        raise AssertionError(f"{name} accepts neither spacing")
    bad = {"structures": [{"begin": "<tool_call>", "schema": {"type": "string", "pattern": "^\\n$"},
                           "end": "</tool_call>"}], "triggers": ["<tool_call>"]}
    if name == "xgrammar":
        with pytest.raises(GrammarError, match="control character"):
            backend.prepare(GrammarSpec("structural_tag", json.dumps(bad)))
