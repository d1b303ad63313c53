"""llguidance backend (`--grammar-backend llguidance`): Earley parser with a lazily built lexer.

Grammars become llguidance grammar strings (regex, JSON Schema, GBNF converted to Lark, structural tags
in SGLang's `structures`/`triggers` form); `prepare` validates them against the tokenizer, which is the
whole compile: token masks are computed per step. Unlike xgrammar, llguidance matches special tokens
only by their token (the text `<think>` in a regex allows the special token `<think>`, not its spelling).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sglang_tpu_qwen.grammar.backend import GrammarBackend, GrammarError, TokenMatcher, VocabInfo, compiler_message
from sglang_tpu_qwen.grammar.schema_check import unenforced_keyword
from sglang_tpu_qwen.grammar.spec import GrammarSpec, structural_tag_object
from sglang_tpu_qwen.grammar.whitespace import JsonWhitespace, as_json_whitespace


class LLGuidanceMatcher(TokenMatcher):
    """llguidance.LLMatcher behind the TokenMatcher interface."""

    def __init__(self, matcher: Any, stop_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop_ids = stop_ids
        self._ended = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token_id: int) -> bool:
        ok = bool(self._m.consume_token(token_id)) and not self._m.is_error()
        # llguidance also reports "stopped" before the stop token (when the grammar cannot go on);
        # generation ends once that stop token is accepted, as with xgrammar.
        self._ended = ok and token_id in self._stop_ids and self._m.is_stopped()
        return ok

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._ended = False  # nothing is accepted after the end: the state before it had not ended


class LLGuidanceBackend(GrammarBackend):
    """Compiles grammars with llguidance for one vocabulary (the model's tokenizer.json, padded to vocab_size).

    Args:
      vocab: the vocabulary (see VocabInfo).
      any_whitespace: the whitespace rule of JSON Schema output (grammar/whitespace.py); True: the default
        bounded runs, False: compact JSON.
    """

    name = "llguidance"

    def __init__(self, vocab: VocabInfo, any_whitespace: bool | JsonWhitespace = True) -> None:
        import llguidance

        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(vocab.tokenizer_file, n_vocab=vocab.vocab_size,
                                                 eos_token=list(vocab.stop_ids))
        self._stop_ids = frozenset(vocab.stop_ids)
        ws = as_json_whitespace(any_whitespace, "llguidance")
        self._json_options: dict[str, Any] = {"whitespace_flexible": not ws.compact}
        if ws.pattern is not None:
            self._json_options["whitespace_pattern"] = ws.pattern

    def _grammar(self, spec: GrammarSpec) -> str:
        llg = self._llg
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "json_schema":
            problem = unenforced_keyword(json.loads(spec.text), self.name)
            if problem is not None:
                raise ValueError(problem)
            return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=self._json_options)
        if spec.kind == "ebnf":
            return llg.grammar_from("ebnf", spec.text)
        if spec.kind == "structural_tag":
            fmt = structural_tag_object(spec.text).get("format", {})
            if fmt.get("type") != "triggered_tags":
                raise ValueError("llguidance takes structural tags in the structures/triggers form only")
            tags = []
            for tag in fmt["tags"]:
                trigger = next((t for t in fmt["triggers"] if tag["begin"].startswith(t)), None)
                if trigger is None:
                    raise ValueError(f"no trigger is a prefix of begin {tag['begin']!r}")
                tags.append(llg.StructTag(trigger=trigger, begin=tag["begin"],
                                          grammar=tag["content"]["json_schema"], end=tag["end"]))
            return llg.StructTag.to_grammar(tags)
        raise ValueError(f"unknown constraint kind {spec.kind!r}")

    def prepare(self, spec: GrammarSpec) -> Any:
        """The validated llguidance grammar string."""
        try:
            grammar = self._grammar(spec)
        except Exception as e:  # ValueError for malformed JSON / GBNF, with the converter's message
            raise GrammarError(compiler_message(spec, e)) from None
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(compiler_message(spec, RuntimeError(messages[0])))
        return grammar

    def compile(self, prepared: Any) -> Any:
        return prepared  # validated in prepare; llguidance builds its lexer lazily per matcher

    def matcher(self, compiled: Any) -> TokenMatcher:
        m = self._llg.LLMatcher(self._tokenizer, compiled)
        if m.is_error():
            raise GrammarError(m.get_error())
        return LLGuidanceMatcher(m, self._stop_ids)
