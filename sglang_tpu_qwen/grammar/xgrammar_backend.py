"""xgrammar backend (the default, as in SGLang): a pushdown automaton with precomputed token-mask tables.

The vocabulary is given to xgrammar as byte-level BPE strings (Qwen's tokenizer), with the model's
vocab_size so padded logit rows exist in the mask and are never allowed. Special tokens keep their text
(as SGLang's `TokenizerInfo.from_huggingface` does), so a grammar may emit `<think>` or `<tool_call>`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sglang_tpu_qwen.grammar.backend import GrammarBackend, GrammarError, TokenMatcher, VocabInfo, compiler_message
from sglang_tpu_qwen.grammar.json_strings import bounded_strings_as_patterns, control_pattern
from sglang_tpu_qwen.grammar.schema_check import unenforced_keyword
from sglang_tpu_qwen.grammar.spec import GrammarSpec, structural_tag_object
from sglang_tpu_qwen.grammar.whitespace import JsonWhitespace, as_json_whitespace


class XGrammarMatcher(TokenMatcher):
    """xgrammar.GrammarMatcher behind the TokenMatcher interface."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:  # the matcher is made with xgrammar's default max_rollback_tokens=-1: unbounded
            self._m.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    """Compiles regex / JSON Schema / EBNF / structural tags with xgrammar for one vocabulary.

    Args:
      vocab: the vocabulary (see VocabInfo).
      any_whitespace: the whitespace rule of JSON Schema output (grammar/whitespace.py); True: the default
        bounded runs, False: compact JSON (`--constrained-json-disable-any-whitespace`).
      max_threads: xgrammar's own compile threads per grammar.
    """

    name = "xgrammar"

    def __init__(self, vocab: VocabInfo, any_whitespace: bool | JsonWhitespace = True, max_threads: int = 2) -> None:
        import xgrammar as xgr  # imports torch: deferred so a server without grammars never pays for it

        self._xgr = xgr
        self._ws = as_json_whitespace(any_whitespace, "xgrammar")
        info = xgr.TokenizerInfo(vocab.tokens, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_ids))
        # The manager caches compiled grammars by spec; xgrammar's own cache would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def prepare(self, spec: GrammarSpec) -> Any:
        """An `xgrammar.Grammar` (parsed, not yet compiled against the vocabulary); for a structural tag the
        `xgrammar.CompiledGrammar` itself."""
        g = self._xgr.Grammar
        try:
            if spec.kind == "regex":
                return g.from_regex(spec.text)
            if spec.kind == "json_schema":
                try:
                    schema = json.loads(spec.text)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"invalid json_schema: not valid JSON: {e}") from None
                problem = unenforced_keyword(schema, self.name)
                if problem is not None:
                    raise GrammarError(f"invalid json_schema: {problem}")
                raw = control_pattern(schema)
                if raw is not None:
                    raise GrammarError(
                        f"invalid json_schema: keyword 'pattern' {raw!r} can match a control character "
                        "(U+0000-U+001F), which a JSON string must escape: the xgrammar grammar backend would emit "
                        "it unescaped (--grammar-backend llguidance enforces it)")
                return g.from_json_schema(json.dumps(bounded_strings_as_patterns(schema)),
                                          any_whitespace=not self._ws.compact, max_whitespace_cnt=self._ws.max_count)
            if spec.kind == "ebnf":
                return g.from_ebnf(spec.text)
            if spec.kind == "structural_tag":
                tag = self._checked_tag(spec)
                # Token formats ({"type": "token", "token": "<tool_call>"}) resolve against the vocabulary,
                # which only the compiler has: a structural tag is compiled here, while it is validated.
                return self._compiler.compile_structural_tag(json.dumps(tag))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own error types with the parser's message
            raise GrammarError(compiler_message(spec, e)) from None
        raise GrammarError(f"unknown constraint kind {spec.kind!r}")

    def _checked_tag(self, spec: GrammarSpec) -> dict[str, Any]:
        """The structural tag object with each tag's JSON schema checked (keywords xgrammar does not enforce, a
        pattern that can match a control character: GrammarError) and its length-bounded strings rewritten
        (grammar/json_strings.py)."""
        obj = structural_tag_object(spec.text)
        fmt = obj.get("format", {})
        for tag in fmt.get("tags", []) if isinstance(fmt, dict) else []:
            content = tag.get("content") if isinstance(tag, dict) else None
            if isinstance(content, dict) and content.get("type") == "json_schema":
                schema = content.get("json_schema")
                problem = unenforced_keyword(schema, self.name)
                if problem is None and (raw := control_pattern(schema)) is not None:
                    problem = f"keyword 'pattern' {raw!r} can match a control character, which JSON must escape"
                if problem is not None:
                    raise GrammarError(f"invalid structural_tag: {problem}")
                content["json_schema"] = bounded_strings_as_patterns(schema)
        return obj

    def compile(self, prepared: Any) -> Any:
        if isinstance(prepared, self._xgr.CompiledGrammar):  # a structural tag (see prepare)
            return prepared
        try:
            return self._compiler.compile_grammar(prepared)
        except Exception as e:
            raise GrammarError(f"grammar compilation failed: {e}") from None

    def matcher(self, compiled: Any) -> TokenMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))
