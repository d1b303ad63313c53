"""The grammar backend interface: prepare (validate), compile, and per-request token matchers.

A backend is built once per engine for the model's vocabulary. `prepare` is cheap (parse and check the
grammar text) and runs while the request is validated, so a bad grammar is a 400; `compile` does the
expensive work (token-mask tables) on the manager's thread pool; `matcher` makes the per-request state.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_tpu_qwen.grammar.spec import GrammarSpec
from sglang_tpu_qwen.utils.errors import InvalidRequestError

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the client needs only the rest.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(InvalidRequestError):
    """A grammar the backend refuses (syntax error, unsupported schema feature); its message is the
    compiler's, fit for a 400."""


def compiler_message(spec: GrammarSpec, error: BaseException) -> str:
    """A client-facing message for a compiler exception: which constraint, then the compiler's words."""
    text = _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
    return f"invalid {spec.kind}: {text}"


@dataclass(frozen=True)
class VocabInfo:
    """The vocabulary a backend compiles for.

    tokens: byte-level BPE strings of ids [0, len(tokens)) ('' for an id the tokenizer lacks).
    vocab_size: rows of the model's logits (config.vocab_size); ids >= len(tokens) are padding, never allowed.
    stop_ids: tokens that end generation (EOS); allowed exactly where the grammar may end.
    tokenizer_file: path of the HF `tokenizer.json` the tokens come from.
    """

    tokens: list[str]
    vocab_size: int
    stop_ids: tuple[int, ...]
    tokenizer_file: str

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32


class TokenMatcher(ABC):
    """The grammar state of one request: which tokens may come next, advanced token by token."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ([B, ceil(V/32)] int32, C-contiguous; bit t % 32
        of word t // 32 set = token t allowed). Does not change the state."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over token_id; False (state unusable) when the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end: generation is over."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a speculative verify step's drafts, checked ahead)."""


class GrammarBackend(ABC):
    """Compiles grammars for one vocabulary (see module docstring). Thread-safe: compile runs on a pool."""

    name: str

    @abstractmethod
    def prepare(self, spec: GrammarSpec) -> Any:
        """Parse and check spec; returns what `compile` takes. Raises GrammarError with the compiler's message."""

    @abstractmethod
    def compile(self, prepared: Any) -> Any:
        """The compiled grammar (shared by every request with the same spec). Raises GrammarError."""

    @abstractmethod
    def matcher(self, compiled: Any) -> TokenMatcher:
        """A fresh matcher at the grammar's start."""
