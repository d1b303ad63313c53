"""Grammar-constrained decoding: regex, JSON Schema, EBNF and structural tags over the model's vocabulary.

How a request gets a constraint: its `sampling_params` carry one of `regex`, `json_schema`, `ebnf`,
`structural_tag` (SGLang's keys; the OpenAI routes map `response_format` onto them with
`spec.response_format_constraint`). The engine turns that into a `GrammarSpec`, validates it through
the engine's `GrammarManager` (a bad grammar is an InvalidRequestError, a 400) and hands the request a
`RequestGrammar`. The scheduler admits the request once its grammar is compiled, fills a token bitmask
row for it each step (`bitmask.token_bitmask`), which the jitted sampling step applies to the logits,
advances the matcher with each accepted token and ends the request when the grammar terminates.

Files: spec.py (the constraint and API mapping), backend.py (interface), xgrammar_backend.py,
llguidance_backend.py, manager.py (backend loading, validation, compile cache and pool),
request_grammar.py (per-request state), bitmask.py (host bitmask layout).
"""

from sglang_tpu_qwen.grammar.backend import GrammarBackend, GrammarError, TokenMatcher, VocabInfo
from sglang_tpu_qwen.grammar.bitmask import token_bitmask
from sglang_tpu_qwen.grammar.manager import GRAMMAR_BACKENDS, GrammarManager, load_backend, vocab_info
from sglang_tpu_qwen.grammar.request_grammar import RequestGrammar
from sglang_tpu_qwen.grammar.spec import CONSTRAINT_KEYS, GrammarSpec, response_format_constraint, spec_from_fields

__all__ = [
    "CONSTRAINT_KEYS", "GRAMMAR_BACKENDS", "GrammarBackend", "GrammarError", "GrammarManager", "GrammarSpec",
    "RequestGrammar", "TokenMatcher", "VocabInfo", "load_backend", "response_format_constraint", "spec_from_fields",
    "token_bitmask", "vocab_info",
]
