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
from sglang_tpu_qwen.grammar.spec import GrammarSpec, structural_tag_object


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


class XGrammarBackend(GrammarBackend):
    """Compiles regex / JSON Schema / EBNF / structural tags with xgrammar for one vocabulary.

    Args:
      vocab: the vocabulary (see VocabInfo).
      any_whitespace: JSON may hold any whitespace between tokens (SGLang's default); False emits compact
        JSON (`--constrained-json-disable-any-whitespace`).
      max_threads: xgrammar's own compile threads per grammar.
    """

    name = "xgrammar"

    def __init__(self, vocab: VocabInfo, any_whitespace: bool = True, max_threads: int = 2) -> None:
        import xgrammar as xgr  # imports torch: deferred so a server without grammars never pays for it

        self._xgr = xgr
        self._any_whitespace = any_whitespace
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
                return g.from_json_schema(spec.text, any_whitespace=self._any_whitespace)
            if spec.kind == "ebnf":
                return g.from_ebnf(spec.text)
            if spec.kind == "structural_tag":
                # Token formats ({"type": "token", "token": "<tool_call>"}) resolve against the vocabulary,
                # which only the compiler has: a structural tag is compiled here, while it is validated.
                return self._compiler.compile_structural_tag(json.dumps(structural_tag_object(spec.text)))
        except Exception as e:  # xgrammar raises RuntimeError / its own error types with the parser's message
            raise GrammarError(compiler_message(spec, e)) from None
        raise GrammarError(f"unknown constraint kind {spec.kind!r}")

    def compile(self, prepared: Any) -> Any:
        if isinstance(prepared, self._xgr.CompiledGrammar):  # a structural tag (see prepare)
            return prepared
        try:
            return self._compiler.compile_grammar(prepared)
        except Exception as e:
            raise GrammarError(f"grammar compilation failed: {e}") from None

    def matcher(self, compiled: Any) -> TokenMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))
