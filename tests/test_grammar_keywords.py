"""Every JSON-Schema keyword is enforced by the compiled grammar or refused with a 400 naming it (issue 13).

For each keyword a satisfying and a violating instance go through the backend's real matcher (tokenized
with the model's tokenizer, then EOS). The outcome must be "enforced" (satisfying accepted, violating
rejected) or "refused" (the backend raises GrammarError naming the keyword). xgrammar and llguidance
differ; each is checked on its own. Keywords: JSON Schema 2020-12 validation and applicator vocabularies
(with draft-7 `dependencies` / `additionalItems` / array `items`), which xgrammar documents.
"""

from __future__ import annotations

import json

import pytest

from sglang_tpu_qwen.grammar.backend import GrammarError
from sglang_tpu_qwen.grammar.manager import load_backend, vocab_info
from sglang_tpu_qwen.grammar.spec import GrammarSpec

INT = {"type": "integer"}
# (keyword a refusal must name, schema, satisfying instance, violating instance)
CASES = [
    ("type", INT, "3", '"x"'),
    ("enum", {"enum": [1, 2]}, "1", "3"),
    ("const", {"const": "a"}, '"a"', '"b"'),
    ("properties", {"type": "object", "properties": {"a": INT}}, '{"a":1}', '{"a":"x"}'),
    ("required", {"type": "object", "properties": {"a": INT}, "required": ["a"]}, '{"a":1}', "{}"),
    ("required", {"type": "object", "required": ["a"]}, '{"a":1}', "{}"),
    ("required", {"type": "object", "additionalProperties": True, "required": ["a"]}, '{"a":1}', "{}"),
    ("additionalProperties", {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
     '{"a":1}', '{"a":1,"b":2}'),
    ("additionalProperties", {"type": "object", "additionalProperties": INT}, '{"b":2}', '{"b":"x"}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": INT}}, '{"xa":1}', '{"xa":"s"}'),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, '{"ab":1}', '{"zz":1}'),
    ("minProperties", {"type": "object", "properties": {"a": INT}, "minProperties": 1}, '{"a":1}', "{}"),
    ("maxProperties", {"type": "object", "properties": {"a": INT, "b": INT}, "maxProperties": 1},
     '{"a":1}', '{"a":1,"b":2}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
     '{"a":1,"b":2}', '{"a":1}'),
    ("dependentSchemas", {"type": "object", "properties": {"a": {}, "b": {}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a":1,"b":2}', '{"a":1}'),
    ("dependencies", {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
     '{"a":1,"b":2}', '{"a":1}'),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
     '{"a":1}', '{"a":1,"b":1}'),
    ("items", {"type": "array", "items": INT}, "[1]", '["x"]'),
    ("items", {"type": "array", "items": [INT]}, "[1]", '["x"]'),
    ("prefixItems", {"type": "array", "prefixItems": [INT], "items": False}, "[1]", "[1,2]"),
    ("items", {"type": "array", "items": [INT], "additionalItems": False}, "[1]", "[1,2]"),  # draft-7 form
    ("unevaluatedItems", {"type": "array", "prefixItems": [INT], "unevaluatedItems": False}, "[1]", "[1,2]"),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 5}}, "[5]", "[1]"),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 5}, "minContains": 2}, "[5,5]", "[5,1]"),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 5}, "maxContains": 1}, "[5]", "[5,5]"),
    ("minItems", {"type": "array", "items": INT, "minItems": 2}, "[1,2]", "[1]"),
    ("maxItems", {"type": "array", "items": INT, "maxItems": 1}, "[1]", "[1,2]"),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, "[1,2]", "[1,1]"),
    ("minLength", {"type": "string", "minLength": 3}, '"abc"', '"a"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "^[a-c]+$"}, '"ab"', '"zz"'),
    ("maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 6}, '"abc"', '"abcdefghij"'),
    ("minLength", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"abc"', '"a"'),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 6}, '"a@b.co"', '"abc@def.com"'),
    ("format", {"type": "string", "format": "date"}, '"2024-01-02"', '"hello"'),
    ("format", {"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"', '"hello"'),
    ("format", {"type": "string", "format": "email"}, '"a@b.co"', '"hello"'),
    ("format", {"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"hello"'),
    ("format", {"type": "string", "format": "ipv4"}, '"1.2.3.4"', '"hello"'),
    ("minimum", {"type": "integer", "minimum": 5}, "5", "4"),
    ("maximum", {"type": "integer", "maximum": 5}, "5", "6"),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 5}, "4", "5"),
    ("minimum", {"type": "number", "minimum": 5}, "5.5", "4.5"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "6", "7"),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.5", "1.3"),
    ("anyOf", {"anyOf": [INT, {"type": "boolean"}]}, "true", '"x"'),
    ("oneOf", {"oneOf": [INT, {"type": "boolean"}]}, "true", '"x"'),
    ("allOf", {"allOf": [INT]}, "1", '"x"'),
    ("allOf", {"allOf": [INT, {"minimum": 3}]}, "4", "2"),
    ("not", {"not": INT}, '"x"', "3"),
    ("if", {"if": INT, "then": {"minimum": 3}, "else": {"type": "string"}}, "4", "1"),
    ("$ref", {"$defs": {"a": INT}, "$ref": "#/$defs/a"}, "1", '"x"'),
    ("$ref", {"definitions": {"a": INT}, "$ref": "#/definitions/a"}, "1", '"x"'),
    ("$ref", {"$ref": "http://example.com/x.json"}, "1", '"x"'),
    ("type", {"type": ["integer", "null"]}, "null", '"x"'),
    ("required", {"type": "object", "properties": {"o": {"type": "object", "required": ["z"]}}},
     '{"o":{"z":1}}', '{"o":{}}'),
]


@pytest.fixture(scope="module")
def vocab(engine):
    cfg = engine.model_config
    stop = set(cfg.eos_token_id) | set(engine.tokenizer.eos_token_ids)
    return vocab_info(engine.tokenizer, cfg.vocab_size, stop)


@pytest.fixture(scope="module")
def backends(vocab):
    """Each backend once, with the server's default JSON whitespace rule (bounded runs)."""
    return {name: load_backend(name, vocab) for name in ("xgrammar", "llguidance")}


def _outcome(backend, tokenizer, eos: int, schema: dict, good: str, bad: str) -> str:
    try:
        compiled = backend.compile(backend.prepare(GrammarSpec("json_schema", json.dumps(schema))))
    except GrammarError as e:
        return f"refused: {e}"

    def accepts(text: str) -> bool:
        m = backend.matcher(compiled)
        return all(m.accept(t) for t in tokenizer.encode(text)) and m.accept(eos) and m.is_terminated()

    return f"good={accepts(good)} bad={accepts(bad)}"


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_every_keyword_enforced_or_refused(engine, vocab, backends, name):
    backend = backends[name]
    eos = vocab.stop_ids[0]
    wrong = []
    for keyword, schema, good, bad in CASES:
        outcome = _outcome(backend, engine.tokenizer, eos, schema, good, bad)
        names = (keyword, "min/max" + keyword[3:])  # llguidance says "min/maxProperties"
        refused_naming_it = outcome.startswith("refused") and any(n in outcome for n in names)
        if outcome != "good=True bad=False" and not refused_naming_it:
            wrong.append(f"{keyword} {json.dumps(schema)}: {outcome}")
    assert not wrong, "\n".join(wrong)


def test_refused_keyword_is_a_400(server):
    """Over HTTP: the schemas of issue 13 that xgrammar would not enforce are 400s naming the keyword."""
    import httpx

    for schema, keyword in (({"type": "object", "required": ["a"]}, "required"),
                            ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 6}, "maxLength"),
                            ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems")):
        r = httpx.post(server.url + "/generate", timeout=60,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": json.dumps(schema)}})
        assert r.status_code == 400, r.text
        assert keyword in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_json_whitespace_is_bounded_by_default(engine, vocab, backends, name):
    """`{"a": {"enum": [1]}}` cannot loop on whitespace: after DEFAULT_MAX_WHITESPACE spaces the grammar
    allows no more, so the value must come."""
    from sglang_tpu_qwen.grammar.whitespace import DEFAULT_MAX_WHITESPACE

    backend = backends[name]
    compiled = backend.compile(backend.prepare(GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}))))
    m = backend.matcher(compiled)
    assert all(m.accept(t) for t in engine.tokenizer.encode('{"a":'))
    space = engine.tokenizer.encode(" ")
    assert len(space) == 1
    accepted = 0
    while accepted <= DEFAULT_MAX_WHITESPACE and m.accept(space[0]):
        accepted += 1
    assert 1 <= accepted <= DEFAULT_MAX_WHITESPACE


def test_whitespace_pattern_flag():
    from sglang_tpu_qwen.grammar.whitespace import resolve_json_whitespace

    assert resolve_json_whitespace("[ \\n\\t]{0,3}").max_count == 3
    assert resolve_json_whitespace("[ \\n\\t\\r]*").max_count is None
    assert resolve_json_whitespace(None, disable_any_whitespace=True).compact
    assert resolve_json_whitespace("( )?", backend="llguidance").pattern == "( )?"
    with pytest.raises(ValueError, match="xgrammar backend takes only a run"):
        resolve_json_whitespace("( )?")


def test_grammar_waits_for_the_end_of_reasoning(engine):
    """require_reasoning: every token is allowed until </think>, the grammar constrains what follows (SGLang's
    ReasonerGrammarObject), so the JSON lands in `content`."""
    import numpy as np

    from sglang_tpu_qwen.grammar.bitmask import token_bitmask, unpack

    tok = engine.tokenizer
    think_end = tok.token_to_id("</think>")
    vocab_size = engine.model_config.vocab_size
    g = engine.grammar.request_grammar(GrammarSpec("json_schema", '{"type": "object"}'), None, think_end)
    while not g.ready():
        pass
    try:
        word = tok.encode("hello")[0]
        assert unpack(token_bitmask([g], 1, vocab_size), vocab_size)[0, word]  # free text while reasoning
        assert not g.advance(word, 0)
        assert not g.advance(think_end, 1)
        allowed = unpack(token_bitmask([g], 1, vocab_size), vocab_size)[0]
        assert not allowed[word] and allowed[tok.encode("{")[0]]  # now JSON only
        assert int(np.sum(allowed)) < vocab_size // 2
    finally:
        g.release()


def test_chat_json_schema_with_reasoning_parser_lands_in_content(engine):
    """--reasoning-parser qwen3, thinking off: the grammar applies from the first token, the JSON is the
    content. Thinking on: the request asks the engine to apply the grammar after the reasoning."""
    import httpx
    from conftest import serve_app

    from sglang_tpu_qwen.server.app import create_app

    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(engine, name)

        def async_generate(self, **kw):
            calls.append(kw)
            return engine.async_generate(**kw)

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with serve_app(create_app(Recording(), reasoning_parser="qwen3")) as url:
        body = {"messages": [{"role": "user", "content": "n?"}], "response_format": rf, "max_tokens": 24,
                "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert isinstance(json.loads(msg["content"])["n"], int) and not msg["reasoning_content"]
        assert "require_reasoning" not in calls[-1]
        body["chat_template_kwargs"] = {"enable_thinking": True}
        body["max_tokens"] = 2
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code == 200
        assert calls[-1]["require_reasoning"] is True
