"""Reasoning and tool-call parsers on real Qwen3.5 token ids, streamed token by token and whole.

Streaming feeds what the engine would stream: the incremental detokenizer's text per generated token
(stop strings cut there). The tool-call grammar is checked token by token with the xgrammar backend over
the same vocabulary.
"""

from __future__ import annotations

import json

import pytest

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
from sglang_tpu_qwen.parsers import ChatOutputParser
from sglang_tpu_qwen.parsers.chat_output import accumulate
from sglang_tpu_qwen.parsers.qwen3_coder import Qwen3CoderParser
from sglang_tpu_qwen.parsers.schema_values import convert_value
from sglang_tpu_qwen.parsers.tool_grammar import tool_call_ebnf
from sglang_tpu_qwen.tokenizer.detokenizer import IncrementalDetokenizer
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

THINK_END_ID, TOOL_CALL_ID = 248069, 248058

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "scale": {"type": "number"}, "where": {"type": "object"},
            "hours": {"type": "array", "items": {"type": "integer"}}, "unit": {"enum": ["c", "f"]},
            "limit": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]

CALLS_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=zip>\n03106\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n<parameter=scale>\n2.50\n</parameter>\n"
    '<parameter=where>\n{"lat": 1.5, "tags": ["a <b>"]}\n</parameter>\n<parameter=hours>\n[6, 18]\n</parameter>\n'
    "<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nline one\nline two\n</parameter>\n</function>\n</tool_call>"
)
WEATHER_ARGS = {"city": "São Paulo", "zip": "03106", "days": 3, "metric": True, "scale": 2.5,
                "where": {"lat": 1.5, "tags": ["a <b>"]}, "hours": [6, 18], "limit": None}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_embedded_model())


def stream_pieces(tok: Tokenizer, ids: list[int], stop: list[str] | None = None) -> list[str]:
    """The text the engine streams per generated token (plus the final flush)."""
    detok = IncrementalDetokenizer(tok, stop=stop)
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        if detok.stopped:
            return pieces
    return [*pieces, detok.flush()]


def run_stream(parser: ChatOutputParser, pieces: list[str]) -> list:
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def both(tok: Tokenizer, ids: list[int], **parser_kwargs):
    """(streamed deltas, accumulated stream, one-shot parse of the full text); asserts they agree."""
    pieces = stream_pieces(tok, ids)
    deltas = run_stream(ChatOutputParser(**parser_kwargs), pieces)
    streamed = accumulate(deltas)
    whole = ChatOutputParser(**parser_kwargs).parse("".join(pieces))
    assert streamed == whole
    return deltas, streamed, whole


def test_reasoning_thinking_on_with_think_end_token(tok):
    ids = tok.encode("The user wants a greeting.\n</think>\n\nHello there!")
    assert THINK_END_ID in ids  # </think> arrives as its own token
    deltas, msg, _ = both(tok, ids, reasoning_parser="qwen3")
    assert msg.reasoning == "The user wants a greeting.\n"
    assert msg.content == "\n\nHello there!"
    assert not any("</think>" in d.reasoning + d.content for d in deltas)
    # Reasoning streams before </think> arrives (not all held to the end).
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert any(d.reasoning for d in deltas[:first_content])


def test_reasoning_think_end_spelled_over_plain_tokens(tok):
    ids = tok.encode("abc <") + tok.encode("/") + tok.encode("think") + tok.encode(">") + tok.encode("def")
    assert THINK_END_ID not in ids and tok.decode(ids) == "abc </think>def"
    deltas, msg, _ = both(tok, ids, reasoning_parser="qwen3")
    assert (msg.reasoning, msg.content) == ("abc ", "def")
    # The partial marker is held back, never streamed as reasoning.
    assert "".join(d.reasoning for d in deltas) == "abc "
    assert not any("<" in d.reasoning or "<" in d.content for d in deltas)


def test_reasoning_off_and_cut_off(tok):
    # enable_thinking false: the template closed the block, the output is content (a stray </think> too).
    _, off, _ = both(tok, tok.encode("Just </think> text"), reasoning_parser="qwen3", thinking=False)
    assert (off.reasoning, off.content) == (None, "Just </think> text")
    # A model that opens <think> itself at the start is reasoning even with thinking off.
    _, opened, _ = both(tok, tok.encode("<think>hm</think>ok"), reasoning_parser="qwen3", thinking=False)
    assert (opened.reasoning, opened.content) == ("hm", "ok")
    # Cut off before </think> (max_tokens): all of it is reasoning, a trailing partial marker included.
    _, cut, _ = both(tok, tok.encode("still thinking </thi"), reasoning_parser="qwen3")
    assert (cut.reasoning, cut.content) == ("still thinking </thi", "")
    # No parser: the text passes through.
    _, raw, _ = both(tok, tok.encode("a</think>b"))
    assert (raw.reasoning, raw.content) == (None, "a</think>b")


def test_tool_calls_typed_by_schema_streamed_incrementally(tok):
    text = "Two lookups.\n</think>\n\n" + CALLS_TEXT
    ids = tok.encode(text)
    assert THINK_END_ID in ids and TOOL_CALL_ID in ids
    deltas, msg, _ = both(tok, ids, reasoning_parser="qwen3", tool_call_parser="qwen3_coder", tools=TOOLS)
    assert msg.reasoning == "Two lookups.\n" and msg.content == ""
    assert [c.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(msg.tool_calls[0].arguments) == WEATHER_ARGS
    assert json.loads(msg.tool_calls[1].arguments) == {"tz": "line one\nline two"}
    # SGLang-style deltas: a call's first piece names it (no arguments), then argument fragments.
    pieces = [c for d in deltas for c in d.tool_calls]
    for index in (0, 1):
        mine = [c for c in pieces if c.index == index]
        assert mine[0].name and mine[0].arguments == ""
        assert all(c.name is None for c in mine[1:]) and len(mine) >= 2
    # Incremental: the first call is named before the second call's text has arrived.
    first_named = next(i for i, d in enumerate(deltas) if any(c.index == 0 and c.name for c in d.tool_calls))
    assert first_named < len(deltas) - 5


def test_tool_call_inside_reasoning_is_reported(tok):
    text = "Let me look.\n" + CALLS_TEXT.split("\n<tool_call>")[0] + "\nThen answer.</think>Done."
    _, msg, _ = both(tok, tok.encode(text), reasoning_parser="qwen3", tool_call_parser="qwen3_coder", tools=TOOLS)
    assert [c.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].arguments) == WEATHER_ARGS
    assert msg.reasoning == "Let me look.\n\nThen answer." and msg.content == "Done."
    # Without the tool parser the block stays visible in the content instead of being dropped.
    _, raw, _ = both(tok, tok.encode(text), reasoning_parser="qwen3")
    assert raw.content.startswith("<tool_call>\n<function=get_weather>") and raw.content.endswith("Done.")


def test_tool_call_edge_cases():
    # Not a qwen3_coder call (no <function=): stays content verbatim.
    content, calls = Qwen3CoderParser.parse('x <tool_call>\n{"name": "f"}\n</tool_call> y', TOOLS)
    assert (content, calls) == ('x <tool_call>\n{"name": "f"}\n</tool_call> y', [])
    # Cut off mid-value: the call is reported with what was written, its JSON closed.
    content, calls = Qwen3CoderParser.parse("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</para")
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"days": "4"}
    # No parameters; function not in tools (values stay strings); text around calls is content.
    content, calls = Qwen3CoderParser.parse(
        "Sure. <tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=other>\n"
        "<parameter=n>\n5\n</parameter>\n</function>\n</tool_call> bye", TOOLS)
    assert content == "Sure.  bye"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("other", {"n": "5"})]


def test_every_chunking_agrees():
    text = ("r <x> </thin</think>\n\nA <tool_c <tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Rome\n</parameter>\n<parameter=days>\n7\n</parameter>\n</function>\n</tool_call> tail")
    kwargs = dict(reasoning_parser="qwen3", tool_call_parser="qwen3_coder", tools=TOOLS)
    whole = ChatOutputParser(**kwargs).parse(text)
    assert whole.reasoning == "r <x> </thin" and whole.content == "\n\nA <tool_c  tail"
    for size in range(1, 9):
        parts = [text[i : i + size] for i in range(0, len(text), size)]
        assert accumulate(run_stream(ChatOutputParser(**kwargs), parts)) == whole, size


def test_stop_string_spanning_tokens_never_partially_emitted(tok):
    # "STOP HERE" spans several tokens; the engine's detokenizer holds its prefix back, so neither the
    # reasoning nor the content side ever shows a piece of it.
    ids = tok.encode("think more</think>answer is STOP HERE and beyond")
    stop = "STOP HERE"
    assert len(tok.encode(stop)) > 1
    pieces = stream_pieces(tok, ids, stop=[stop])
    deltas = run_stream(ChatOutputParser(reasoning_parser="qwen3"), pieces)
    msg = accumulate(deltas)
    assert (msg.reasoning, msg.content) == ("think more", "answer is ")
    assert not any(s in d.reasoning + d.content for d in deltas for s in ("STOP", "ST", "HERE"))


def test_schema_typing():
    assert convert_value("03106", {"type": "string"}) == "03106"
    assert convert_value("03106", {"type": ["string", "integer"]}) == "03106"
    assert convert_value("42", {"type": "integer"}) == 42
    assert convert_value("4.0", {"type": "number"}) == 4.0 and convert_value("5", {"type": "number"}) == 5
    assert convert_value("nan", {"type": "number"}) == "nan"  # not a JSON number: kept as text
    assert convert_value("False", {"type": "boolean"}) is False
    assert convert_value("maybe", {"type": "boolean"}) == "maybe"
    assert convert_value("{'a': 1}", {"type": "object"}) == {"a": 1}
    assert convert_value("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "null"}]}) == [1, 2]
    assert convert_value("7", {"enum": [7, 8]}) == 7
    assert convert_value("NULL", {"type": "integer"}) is None
    assert convert_value("12", None) == "12"  # not in the schema


@pytest.fixture(scope="module")
def grammar_backend(tok):
    from sglang_tpu_qwen.grammar.manager import load_backend, vocab_info

    return load_backend("xgrammar", vocab_info(tok, 248320, tok.eos_token_ids))


def grammar_accepts(backend, tok: Tokenizer, ebnf: str, text: str) -> bool:
    """True when the grammar takes the token ids of `text` and may end right after them."""
    from sglang_tpu_qwen.grammar.spec import GrammarSpec

    matcher = backend.matcher(backend.compile(backend.prepare(GrammarSpec("ebnf", ebnf))))
    return all(matcher.accept(i) for i in tok.encode(text)) and matcher.accept(tok.eos_token_ids[-1])


def test_tool_grammar_accepts_exactly_parseable_calls(grammar_backend, tok):
    tools = [TOOLS[0], TOOLS[1]]
    call = CALLS_TEXT.split("\n<tool_call>")[0].replace("São Paulo", "Sao Paulo")
    required = tool_call_ebnf(tools, thinking=True)
    assert grammar_accepts(grammar_backend, tok, required, "Checking.</think>\n\n" + CALLS_TEXT.replace(
        "São", "Sao").replace("[\"a <b>\"]", "[\"a \\u003cb>\"]"))
    # Thinking off: the call comes first; a named function allows exactly one call of it.
    named = tool_call_ebnf(tools, "get_weather", thinking=False)
    ok = call.replace('["a <b>"]', '["a \\u003cb>"]')
    assert grammar_accepts(grammar_backend, tok, named, ok)
    content, calls = Qwen3CoderParser.parse(ok, tools)
    assert content == "" and json.loads(calls[0].arguments)["where"] == {"lat": 1.5, "tags": ["a <b>"]}
    rejected = [
        ok + "\n" + ok,  # a second call
        ok.replace("<parameter=city>\nSao Paulo\n</parameter>\n", ""),  # required parameter missing
        ok.replace("Sao Paulo", "Sao <b> Paulo"),  # '<' in free text could fake a tag
        ok.replace("<parameter=days>\n3\n", "<parameter=days>\nthree\n"),  # not an integer
        "Why?</think>\n\n" + ok,  # reasoning with thinking off
    ]
    for text in rejected:
        assert not grammar_accepts(grammar_backend, tok, named, text), text
    assert not grammar_accepts(grammar_backend, tok, tool_call_ebnf(tools, "get_time", thinking=False), ok)
    with pytest.raises(ValueError, match="not in `tools`"):
        tool_call_ebnf(tools, "nope")
