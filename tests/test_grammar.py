"""Constrained decoding on the embedded model: outputs are in the grammar's language, for both backends.

The model has random weights, so unconstrained text is gibberish: every structure checked below (regex
match, schema validity, EBNF language) comes from the grammar mask. The session `engine` compacts JSON
(conftest: constrained_json_disable_any_whitespace), else the model pads JSON with whitespace forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from concurrent.futures import Future

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.engine.runner.sampler import apply_token_bitmask
from sglang_tpu_qwen.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarManager,
    GrammarSpec,
    response_format_constraint,
    spec_from_fields,
    token_bitmask,
    vocab_info,
)
from sglang_tpu_qwen.grammar.bitmask import clear_from, unpack

GREEDY = {"temperature": 0}
REGEX = r"(yes|no), [0-9]{2,4}!"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
# EBNF (GBNF) and a Python regex for the same finite language.
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= "cat" | "dog" | [0-9] [0-9]?'
EBNF_LANGUAGE = r"\((cat|dog|[0-9][0-9]?)(,(cat|dog|[0-9][0-9]?)){0,2}\)"


def _wait_idle_matchers(engine, timeout: float = 30.0) -> None:
    """Every matcher released (requests finish on the scheduler thread, just after their reply is sent)."""
    deadline = time.monotonic() + timeout
    while engine.grammar.num_live_matchers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.grammar.num_live_matchers == 0


def _texts(outs: dict | list[dict]) -> list[str]:
    return [o["text"] for o in (outs if isinstance(outs, list) else [outs])]


# ---------------------------------------------------------------- units (no model)


def test_spec_fields_and_response_format() -> None:
    assert spec_from_fields({"regex": "a+", "ebnf": None}) == GrammarSpec("regex", "a+")
    assert spec_from_fields({"json_schema": {"type": "integer"}}) == GrammarSpec("json_schema", '{"type": "integer"}')
    assert spec_from_fields({"temperature": 0}) is None
    with pytest.raises(ValueError, match="only one constraint"):
        spec_from_fields({"regex": "a", "json_schema": "{}"})
    with pytest.raises(ValueError, match="must be a string"):
        spec_from_fields({"regex": 5})
    assert response_format_constraint(None) == response_format_constraint({"type": "text"}) == {}
    assert response_format_constraint({"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert json.loads(response_format_constraint(rf)["json_schema"]) == SCHEMA
    with pytest.raises(ValueError, match="response_format.type"):
        response_format_constraint({"type": "yaml"})
    with pytest.raises(ValueError, match="json_schema"):
        response_format_constraint({"type": "json_schema", "json_schema": "not an object"})


class _Rows:
    """Fills a fixed allowed set into its row (a stand-in matcher for the layout test)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        words = bitmask.view(np.uint32)
        for t in self.allowed:
            words[row, t // 32] |= np.uint32(1 << (t % 32))


def test_bitmask_layout_host_and_device_agree() -> None:
    vocab = 100  # 4 words, the last one partial
    allowed = [0, 31, 32, 63, 64, 95, 99]
    assert token_bitmask([None, None], 4, vocab) is None
    mask = token_bitmask([None, _Rows(allowed), None], 4, vocab)
    assert mask.shape == (4, 4) and mask.dtype == np.int32
    host = unpack(mask, vocab)
    assert host[0].all() and host[2].all() and host[3].all()  # unconstrained and padding rows: everything
    assert np.flatnonzero(host[1]).tolist() == allowed
    clear_from(mask, 1, 64)  # "tokenizer knows 64 ids": padded ids 64.. never allowed
    assert np.flatnonzero(unpack(mask, vocab)[1]).tolist() == [0, 31, 32, 63]
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, vocab)).astype(np.float32))
    masked, dev_allowed = apply_token_bitmask(logits, jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(dev_allowed), unpack(mask, vocab))  # bit 31 (sign bit) included
    np.testing.assert_array_equal(np.asarray(masked)[0], np.asarray(logits)[0])
    assert int(np.argmax(np.asarray(masked)[1])) in [0, 31, 32, 63]


# ---------------------------------------------------------------- engine, xgrammar (default backend)


def test_regex_greedy_and_sampled_fullmatch(engine) -> None:
    greedy = engine.generate("Answer:", {**GREEDY, "regex": REGEX, "max_new_tokens": 32})
    sampled = engine.generate("Answer:", {"temperature": 1.0, "seed": 5, "n": 2, "regex": REGEX,
                                          "max_new_tokens": 32})
    for out in [greedy, *sampled]:
        assert re.fullmatch(REGEX, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["meta_info"]["finish_reason"]["matched"] in engine.tokenizer.eos_token_ids
    assert len({o["text"] for o in sampled}) > 1  # temperature 1 really samples inside the language
    unconstrained = engine.generate("Answer:", {**GREEDY, "max_new_tokens": 8})
    assert not re.fullmatch(REGEX, unconstrained["text"])
    _wait_idle_matchers(engine)


def test_json_schema_validates(engine) -> None:
    outs = engine.generate(["JSON:", "Describe a person as JSON."],
                           [{**GREEDY, "json_schema": json.dumps(SCHEMA), "max_new_tokens": 64},
                            {"temperature": 1.0, "seed": 3, "json_schema": json.dumps(SCHEMA), "max_new_tokens": 64}])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_ebnf_in_language(engine) -> None:
    for params in ({**GREEDY}, {"temperature": 1.0, "seed": 11}):
        out = engine.generate("List:", {**params, "ebnf": EBNF, "max_new_tokens": 32})
        assert re.fullmatch(EBNF_LANGUAGE, out["text"]), out["text"]


def test_structural_tag_forces_the_tag(engine) -> None:
    args_schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    # Regex content: a json_schema content would allow free whitespace (the flag covers json_schema requests).
    content = {"type": "regex", "pattern": r'\{"city": "(Paris|Rome)"\}'}
    # begin/end as token formats: the special tokens themselves, not their text spelled with other tokens.
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": {"type": "token", "token": "<tool_call>"},
                                                "end": {"type": "token", "token": "</tool_call>"},
                                                "content": content}}
    out = engine.generate("Call:", {**GREEDY, "structural_tag": json.dumps(tag), "max_new_tokens": 48,
                                    "skip_special_tokens": False})
    m = re.fullmatch(r"<tool_call>(.*)</tool_call>(<\|im_end\|>|<\|endoftext\|>)?", out["text"], re.S)
    assert m, out["text"]
    jsonschema.validate(json.loads(m.group(1)), args_schema)
    ids = out["output_ids"]
    assert ids[0] == engine.tokenizer.token_to_id("<tool_call>") and engine.tokenizer.token_to_id("</tool_call>") in ids


def test_padded_vocab_rows_and_eos_where_grammar_ends(engine) -> None:
    tok_vocab, model_vocab = engine.tokenizer.vocab_size, engine.model_config.vocab_size
    assert model_vocab > tok_vocab  # the embedded model pads its logits like Qwen3.5 (248320 > 248077)
    g = engine.grammar.request_grammar(GrammarSpec("regex", r"[\s\S]*"))  # any text at all
    g._compiled.result(timeout=60)
    assert g.ready()
    try:
        allowed = unpack(token_bitmask([g], 1, model_vocab), model_vocab)[0]
        # Every token but lone UTF-8 continuation/invalid bytes; never a padded row.
        assert allowed[:94].all() and allowed[:tok_vocab].mean() > 0.99 and not allowed[tok_vocab:].any()
        assert all(allowed[e] for e in engine.tokenizer.eos_token_ids)  # the empty string is in the language
    finally:
        g.release()
    g = engine.grammar.request_grammar(GrammarSpec("regex", "ab"))
    g._compiled.result(timeout=60)
    g.ready()
    try:
        eos = engine.tokenizer.eos_token_ids[0]
        assert not unpack(token_bitmask([g], 1, model_vocab), model_vocab)[0][eos]  # cannot end before "ab"
        assert g.advance(engine.tokenizer.token_to_id("ab"), 0) is False
        assert g.advance(engine.tokenizer.token_to_id("ab"), 0) is False  # a consumed position is ignored
        only = np.flatnonzero(unpack(token_bitmask([g], 1, model_vocab), model_vocab)[0])
        assert set(only.tolist()) <= set(engine.tokenizer.eos_token_ids) | set(engine.model_config.eos_token_id)
        assert g.advance(eos, 1) is True and g.end_reason(eos) == {"type": "stop", "matched": eos}
    finally:
        g.release()
    _wait_idle_matchers(engine)


def test_unconstrained_rows_unchanged_and_logprobs_raw(engine) -> None:
    prompts = ["The quick brown fox", "Answer:"]
    alone = engine.generate(prompts[0], {**GREEDY, "max_new_tokens": 10, "ignore_eos": True})
    mixed = engine.generate(prompts, [{**GREEDY, "max_new_tokens": 10, "ignore_eos": True},
                                      {**GREEDY, "regex": REGEX, "max_new_tokens": 32}])
    assert mixed[0]["output_ids"] == alone["output_ids"]
    assert re.fullmatch(REGEX, mixed[1]["text"])
    constrained = engine.generate(prompts[1], {**GREEDY, "regex": REGEX, "max_new_tokens": 32}, return_logprob=True)
    assert constrained["output_ids"] == mixed[1]["output_ids"]
    # Reported logprobs are the model's (raw logits), not the masked distribution: re-score the same tokens
    # as a prompt and compare.
    prompt_ids = engine.tokenizer.encode(prompts[1])
    out_ids = constrained["output_ids"]
    scored = engine.generate(input_ids=prompt_ids + out_ids, sampling_params={"max_new_tokens": 0},
                             return_logprob=True, logprob_start_len=len(prompt_ids))
    want = [t[0] for t in scored["meta_info"]["input_token_logprobs"]]
    got = [t[0] for t in constrained["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(got, want, atol=2e-3)
    assert sum(got) < -1.0  # the mask forced tokens the raw model finds unlikely
    _wait_idle_matchers(engine)


def test_invalid_grammars_raise_with_compiler_message(engine) -> None:
    cases = [({"regex": "(abc"}, "parenthesis"), ({"json_schema": '{"type": "foo"}'}, 'Unsupported type "foo"'),
             ({"json_schema": '{"type": '}, "JSON"), ({"ebnf": 'root ::= "a" |'}, "EBNF parser error"),
             ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one constraint")]
    for params, message in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            engine.generate("x", params)
    with pytest.raises(GrammarError, match="invalid regex"):
        engine.generate("x", {"regex": "(abc"})  # cached: the same error again


def test_retraction_keeps_the_matcher_consistent(engine, caplog) -> None:
    """Two constrained requests outgrow the free pages: the newer is retracted mid-decode, re-prefills its
    prompt + output and must continue the grammar where it stopped (not re-feed those tokens to it)."""
    caplog.set_level(logging.INFO, logger="sglang_tpu_qwen.engine.scheduler.scheduler")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 240000, size=20).tolist() for _ in range(2)]
    params = {**GREEDY, "regex": "[0-9]{40}", "max_new_tokens": 48}  # digits are single tokens: 41 with EOS
    alone = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    assert engine.flush_cache()  # idle now: the scheduler touches no pool until the next submit
    pool = engine.scheduler.ranks[0].kv_pool
    held = pool.alloc(pool.num_free - 6)  # each request needs 4 pages of 16 tokens, both together 8
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        assert engine.flush_cache()
        pool.free(held)
    assert any("retracting request" in rec.getMessage() for rec in caplog.records)
    for out, ref in zip(outs, alone, strict=True):
        assert re.fullmatch("[0-9]{40}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["output_ids"] == ref["output_ids"]
    _wait_idle_matchers(engine)


def test_abort_frees_the_matcher(engine) -> None:
    it = engine.generate("abort me", {**GREEDY, "regex": "[a-z ]{200}", "max_new_tokens": 200}, stream=True)
    first = next(it)
    assert engine.grammar.num_live_matchers == 1
    engine.abort(first["meta_info"]["id"])
    assert list(it)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle_matchers(engine)


class _GatedBackend(GrammarBackend):
    """Delegates to a real backend; compile waits for `gate` (a slow grammar)."""

    name = "gated"

    def __init__(self, inner: GrammarBackend, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def prepare(self, spec):
        return self.inner.prepare(spec)

    def compile(self, prepared):
        assert self.gate.wait(120)
        return self.inner.compile(prepared)

    def matcher(self, compiled):
        return self.inner.matcher(compiled)


def _swap_backend(engine, monkeypatch, backend: GrammarBackend | str) -> GrammarManager:
    cfg = engine.model_config
    manager = GrammarManager(backend, vocab_info(engine.tokenizer, cfg.vocab_size,
                                                 set(cfg.eos_token_id) | set(engine.tokenizer.eos_token_ids)),
                             any_whitespace=False)
    monkeypatch.setattr(engine, "grammar", manager)
    return manager


def test_compiling_request_waits_while_the_batch_runs(engine, monkeypatch) -> None:
    gate = threading.Event()
    manager = _swap_backend(engine, monkeypatch, _GatedBackend(engine.grammar.backend(), gate))
    result: list[dict] = []
    waiter = threading.Thread(target=lambda: result.append(
        engine.generate("Answer:", {**GREEDY, "regex": REGEX, "max_new_tokens": 32})))
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while engine.get_server_info()["num_waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        free = engine.generate("Meanwhile", {**GREEDY, "max_new_tokens": 4, "ignore_eos": True})
        assert len(free["output_ids"]) == 4
        assert engine.get_server_info()["num_waiting"] == 1 and not result  # still compiling, not admitted
    finally:
        gate.set()
        waiter.join(timeout=120)
    assert re.fullmatch(REGEX, result[0]["text"])
    assert manager.num_live_matchers == 0
    manager.shutdown()


def test_constrained_request_waits_for_the_backend_load_without_blocking_the_loop(engine, monkeypatch) -> None:
    """The backend loads in the background after the precompile: a constrained request that comes first
    waits for it on the event loop (other requests and /health keep being served), then runs constrained."""
    manager = _swap_backend(engine, monkeypatch, engine.grammar.backend())
    loaded = manager._backend
    manager._backend = pending = Future()  # a load still running
    ticks: list[int] = []
    at_release: list[int] = []

    def release_after_the_loop_ticked() -> None:
        deadline = time.monotonic() + 60  # only a blocked loop reaches it (then the assert below fails)
        while len(ticks) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        at_release.append(len(ticks))
        pending.set_result(loaded.result())

    async def scenario() -> dict:
        task = asyncio.ensure_future(engine.async_generate(
            text="Answer:", sampling_params={**GREEDY, "regex": REGEX, "max_new_tokens": 32}))
        threading.Thread(target=release_after_the_loop_ticked, daemon=True).start()
        while not task.done():
            ticks.append(1)
            await asyncio.sleep(0.001)
        return task.result()

    out = asyncio.run(scenario())
    assert at_release[0] >= 5  # the event loop ran while the request waited for the backend
    assert re.fullmatch(REGEX, out["text"])
    manager.shutdown()


class _FailingCompile(_GatedBackend):
    """Validates like the real backend, then fails to compile (e.g. a resource limit)."""

    def compile(self, prepared):
        raise GrammarError("grammar compilation failed: too large")


def test_failed_compile_aborts_only_that_request(engine, monkeypatch) -> None:
    manager = _swap_backend(engine, monkeypatch, _FailingCompile(engine.grammar.backend(), threading.Event()))
    out = engine.generate("x", {**GREEDY, "regex": "[0-9]+", "max_new_tokens": 4})
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "grammar compilation failed: too large"}
    with pytest.raises(GrammarError, match="too large"):  # the cached failure answers the next one at once
        engine.generate("x", {**GREEDY, "regex": "[0-9]+", "max_new_tokens": 4})
    assert len(engine.generate("x", {**GREEDY, "max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2
    manager.shutdown()


def test_backend_none_refuses_constraints(engine, monkeypatch) -> None:
    monkeypatch.setattr(engine, "grammar", None)
    with pytest.raises(InvalidRequestError, match="grammar-backend none"):
        engine.generate("x", {"regex": "a"})


# ---------------------------------------------------------------- engine, llguidance backend


def test_llguidance_backend(engine, monkeypatch) -> None:
    manager = _swap_backend(engine, monkeypatch, "llguidance")
    assert manager.backend().name == "llguidance"
    outs = engine.generate(["Answer:", "Answer:"], [{**GREEDY, "regex": REGEX, "max_new_tokens": 32},
                                                    {"temperature": 1.0, "seed": 2, "regex": REGEX,
                                                     "max_new_tokens": 32}])
    outs += engine.generate(["JSON:", "List:"], [{"temperature": 1.0, "seed": 2, "json_schema": json.dumps(SCHEMA),
                                                  "max_new_tokens": 64},
                                                 {**GREEDY, "ebnf": EBNF, "max_new_tokens": 32}])
    assert re.fullmatch(REGEX, outs[0]["text"]) and re.fullmatch(REGEX, outs[1]["text"])
    jsonschema.validate(json.loads(outs[2]["text"]), SCHEMA)
    assert re.fullmatch(EBNF_LANGUAGE, outs[3]["text"])
    with pytest.raises(GrammarError, match="unclosed group"):
        engine.generate("x", {"regex": "(abc"})
    assert manager.num_live_matchers == 0
    manager.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_fill_drafts_checks_ahead_and_rolls_back(engine, monkeypatch, backend: str) -> None:
    """A speculative verify step's masks (RequestGrammar.fill_drafts): row j is the mask after the accepted
    output and drafts[:j], equal to advancing token by token; drafts stop at the first one the grammar refuses;
    the matcher ends where it began, so advancing over the accepted tokens afterwards works as in plain
    decoding."""
    manager = _swap_backend(engine, monkeypatch, backend)
    spec = spec_from_fields({"regex": REGEX})
    vocab = engine.model_config.vocab_size
    width = (vocab + 31) // 32
    ids = engine.tokenizer.encode("yes, 1234!")
    g, ref = manager.request_grammar(spec), manager.request_grammar(spec)
    manager.submit(spec).result(timeout=60)
    assert g.ready() and ref.ready()
    assert not g.advance(ids[0], 0) and not ref.advance(ids[0], 0)  # one accepted output token
    drafts = ids[1:]
    rows = np.full((len(drafts) + 1, width), -1, np.int32)
    assert g.fill_drafts(rows, drafts) == len(drafts)
    for j, tok in enumerate(drafts):  # the same masks, token by token
        want = token_bitmask([ref], 1, vocab)
        np.testing.assert_array_equal(rows[j], want[0])
        assert not ref.advance(tok, j + 1)
    # A refused draft (a letter where a digit or "!" must come) cuts the drafts there.
    bad = engine.tokenizer.encode("x")[0]
    rows = np.full((4, width), -1, np.int32)
    assert g.fill_drafts(rows, [*drafts[:2], bad]) == 2
    # Rolled back: the accepted tokens advance the matcher as plain decoding's do, to the grammar's end.
    assert not any(g.advance(tok, i + 1) for i, tok in enumerate(drafts))
    assert g.advance(engine.tokenizer.eos_token_ids[0], len(ids))  # the stop token where the grammar may end
    g.release()
    ref.release()
    assert manager.num_live_matchers == 0
    manager.shutdown()


def test_everything_returned(engine) -> None:
    _wait_idle_matchers(engine)
    assert engine.flush_cache()
    mem = engine.get_server_info()["memory"]
    assert mem["kv_pages_free"] == mem["kv_pages_total"]
    assert mem["gdn_slots_free"] == mem["gdn_slots_total"]
    assert mem.get("snapshot_slots_free") == mem.get("snapshot_slots_total")
