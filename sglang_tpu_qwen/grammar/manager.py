"""GrammarManager: one per engine; loads the backend, validates and compiles grammars off the critical path.

`submit(spec)` runs on the caller's thread (the engine validating a request): it parses the grammar
(cheap; a bad one raises GrammarError, a 400) and returns a future of the compiled grammar, shared by
every request with the same (kind, text) through an LRU cache. Compiles run on a small thread pool; the
scheduler keeps a request waiting until its grammar is compiled while the batch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_tpu_qwen.grammar.backend import GrammarBackend, TokenMatcher, VocabInfo
from sglang_tpu_qwen.grammar.request_grammar import RequestGrammar
from sglang_tpu_qwen.grammar.spec import GrammarSpec
from sglang_tpu_qwen.grammar.whitespace import JsonWhitespace

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")


def load_backend(name: str, vocab: VocabInfo, any_whitespace: bool | JsonWhitespace = True) -> GrammarBackend:
    """Build the backend `name` (xgrammar or llguidance) for vocab. Raises ValueError for another name."""
    t0 = time.perf_counter()
    if name == "xgrammar":
        from sglang_tpu_qwen.grammar.xgrammar_backend import XGrammarBackend

        backend: GrammarBackend = XGrammarBackend(vocab, any_whitespace)
    elif name == "llguidance":
        from sglang_tpu_qwen.grammar.llguidance_backend import LLGuidanceBackend

        backend = LLGuidanceBackend(vocab, any_whitespace)
    else:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")
    logger.info("grammar backend %s ready for %d tokens (%d logit rows) in %.1f s", name, len(vocab.tokens),
                vocab.vocab_size, time.perf_counter() - t0)
    return backend


def vocab_info(tokenizer: Any, vocab_size: int, stop_ids: set[int] | tuple[int, ...]) -> VocabInfo:
    """VocabInfo of a `tokenizer.tokenizer.Tokenizer` for a model with vocab_size logit rows."""
    n = min(tokenizer.vocab_size, vocab_size)
    tokens = [tokenizer.id_to_token(i) or "" for i in range(n)]
    return VocabInfo(tokens, vocab_size, tuple(sorted(stop_ids)), str(Path(tokenizer.path) / "tokenizer.json"))


def _log_load_failure(fut: Future) -> None:
    if fut.exception() is not None:
        logger.error("grammar backend failed to load; constrained requests will fail: %r", fut.exception())


class GrammarManager:
    """Backend, compile cache and thread pool of one engine (see module docstring).

    Args:
      backend: "xgrammar" or "llguidance" (a name, loaded in the background now) or a GrammarBackend.
      vocab: the vocabulary; vocab.vocab_size is the bitmask's token count.
      any_whitespace: the JSON whitespace rule (grammar/whitespace.py; a bool is the older form), passed to
        the backend.
      workers: compile threads.
      cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, backend: str | GrammarBackend, vocab: VocabInfo, any_whitespace: bool | JsonWhitespace = True,
                 workers: int = 2, cache_size: int = 512) -> None:
        self.vocab_size = vocab.vocab_size
        self.vocab_limit = len(vocab.tokens)  # ids at or above this are padding rows of the logits
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        if isinstance(backend, GrammarBackend):
            self._backend: Future = Future()
            self._backend.set_result(backend)
        else:
            self._backend = self._pool.submit(load_backend, backend, vocab, any_whitespace)
            self._backend.add_done_callback(_log_load_failure)
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._live_matchers = 0

    def backend(self) -> GrammarBackend:
        """The backend, waiting for it to load. Raises the load's exception (e.g. the package is missing)."""
        return self._backend.result()

    def backend_loaded(self) -> bool:
        """True once the background load finished (successfully or not): `backend()` no longer blocks."""
        return self._backend.done()

    async def wait_loaded(self) -> None:
        """Wait for the background load without blocking the event loop (an HTTP handler calls this before
        `submit`, which would otherwise block the loop, /health included, until the load ends). A failed
        load is not raised here: `submit` raises it with its message."""
        with contextlib.suppress(Exception):
            # shield: a cancelled request must not cancel the engine's one backend load.
            await asyncio.shield(asyncio.wrap_future(self._backend))

    def submit(self, spec: GrammarSpec) -> Future:
        """Validate spec now and return the future of its compiled grammar (cached by spec).

        Raises GrammarError (an InvalidRequestError) with the compiler's message for a bad grammar.
        """
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
        if fut is not None:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
            return fut
        backend = self.backend()
        prepared = backend.prepare(spec)
        with self._lock:
            fut = self._cache.get(spec)
            if fut is None:
                fut = self._pool.submit(self._compile, backend, spec, prepared)
                self._cache[spec] = fut
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)  # requests holding its future keep it alive
        return fut

    @staticmethod
    def _compile(backend: GrammarBackend, spec: GrammarSpec, prepared: Any) -> Any:
        t0 = time.perf_counter()
        compiled = backend.compile(prepared)
        logger.debug("compiled %s grammar (%d chars) in %.3f s", spec.kind, len(spec.text), time.perf_counter() - t0)
        return compiled

    def request_grammar(self, spec: GrammarSpec, compiled: Future | None = None,
                        think_end_id: int | None = None) -> RequestGrammar:
        """A fresh per-request state for spec over `compiled` (a `submit(spec)` future; submitted now if None).

        think_end_id: the output starts inside the model's reasoning; the grammar applies after this token
        (SGLang's ReasonerGrammarObject, for `require_reasoning` requests).
        """
        return RequestGrammar(spec, self.submit(spec) if compiled is None else compiled, self, think_end_id)

    def new_matcher(self, compiled: Any) -> TokenMatcher:
        """A matcher for a compiled grammar; counted until `matcher_released`."""
        m = self.backend().matcher(compiled)
        with self._lock:
            self._live_matchers += 1
        return m

    def matcher_released(self) -> None:
        with self._lock:
            self._live_matchers -= 1

    @property
    def num_live_matchers(self) -> int:
        """Matchers of requests not yet finished (0 when idle: a leak check)."""
        return self._live_matchers

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def create_grammar_manager(backend: str, tokenizer: Any, vocab_size: int, stop_ids: set[int],
                           any_whitespace: bool | JsonWhitespace = True) -> GrammarManager | None:
    """The engine's manager for `--grammar-backend` (None for "none"); the backend loads in the background.

    tokenizer: a `tokenizer.tokenizer.Tokenizer`; vocab_size: the model's logit rows; stop_ids: EOS ids.
    """
    if backend == "none":
        return None
    if backend not in GRAMMAR_BACKENDS:
        raise ValueError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {backend!r}")
    return GrammarManager(backend, vocab_info(tokenizer, vocab_size, stop_ids), any_whitespace)
