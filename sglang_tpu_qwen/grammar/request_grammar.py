"""RequestGrammar: the grammar state one request carries through the scheduler.

Lifecycle (all calls but construction on the scheduler thread): `ready()` until the compiled grammar is
there (the scheduler does not admit the request before); `fill(bitmask, row)` each step it samples;
`advance(token, position)` for each token it accepts; `release()` when it finishes or is aborted.
Retraction keeps the state: the request re-prefills prompt + output without accepting those tokens
again, and `advance` ignores a position it has already consumed, so the matcher never sees a token twice.

With a `think_end_id` (a request whose output starts inside the model's reasoning, SGLang's
`require_reasoning`), every token is allowed until that token; the grammar constrains what follows it, so
schema-constrained output lands in the reply's `content`, after the reasoning, as in SGLang.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_tpu_qwen.grammar.backend import TokenMatcher
from sglang_tpu_qwen.grammar.bitmask import allows, clear_from
from sglang_tpu_qwen.grammar.spec import GrammarSpec

if TYPE_CHECKING:
    from sglang_tpu_qwen.grammar.manager import GrammarManager

logger = logging.getLogger(__name__)


class RequestGrammar:
    """Per-request matcher over a (possibly still compiling) shared grammar.

    Args:
      spec: the constraint (for messages).
      compiled: future of the backend's compiled grammar (from GrammarManager.submit).
      manager: the owner; makes the matcher and counts live ones.
      think_end_id: constrain only the tokens after this one (None: from the first output token).
    """

    def __init__(self, spec: GrammarSpec, compiled: Future, manager: GrammarManager,
                 think_end_id: int | None = None) -> None:
        self.spec = spec
        self._compiled = compiled
        self._manager = manager
        self._matcher: TokenMatcher | None = None
        self.num_accepted = 0  # output tokens the matcher has consumed
        self.rejected_token: int | None = None
        self.released = False
        self.think_end_id = think_end_id
        self.in_reasoning = think_end_id is not None

    def ready(self) -> bool:
        """True once the matcher exists (making it when the compile just finished); False while compiling.

        Raises GrammarError when the compile failed (the request cannot run).
        """
        if self._matcher is not None:
            return True
        if not self._compiled.done():
            return False
        compiled: Any = self._compiled.result()  # re-raises the compile's GrammarError
        self._matcher = self._manager.new_matcher(compiled)
        return True

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] ([B, ceil(V/32)] int32); padded ids never allowed."""
        assert self._matcher is not None, "fill before ready()"
        self._fill_row(bitmask, row, self.in_reasoning)

    def _fill_row(self, bitmask: np.ndarray, row: int, in_reasoning: bool) -> None:
        assert self._matcher is not None
        if not in_reasoning:  # inside the reasoning the row stays as it is: every token allowed
            self._matcher.fill_bitmask(bitmask, row)
        clear_from(bitmask, row, self._manager.vocab_limit)

    def fill_drafts(self, bitmask: np.ndarray, drafts: list[int]) -> int:
        """The masks of a speculative verify step: bitmask[j] ([1 + len(drafts), ceil(V/32)] int32, all ones on
        entry) gets the tokens allowed after the accepted output and drafts[:j]. Stops at the first draft the
        grammar does not allow (the target cannot sample it there) or that ends the grammar (the target's own
        token at that position is sampled instead); returns how many drafts go on, and fills that many rows
        plus one. The matcher is left as it was (advanced over the drafts, then rolled back): the verify
        step's accepted tokens `advance` it as plain decoding's do."""
        assert self._matcher is not None, "fill_drafts before ready()"
        in_reasoning, consumed, n = self.in_reasoning, 0, 0
        while True:
            self._fill_row(bitmask, n, in_reasoning)
            if n == len(drafts):
                break
            d = drafts[n]
            if not allows(bitmask, n, d):
                break
            if in_reasoning:
                in_reasoning = d != self.think_end_id
            else:
                ok = self._matcher.accept(d)
                consumed += ok
                if not ok or self._matcher.is_terminated():
                    break
            n += 1
        self._matcher.rollback(consumed)
        return n

    def advance(self, token: int, position: int) -> bool:
        """Consume output token number `position` (0-based); True when generation must end here.

        It ends when the matcher terminated (a stop token where the grammar may end) or rejected the
        token (`rejected_token` set; only possible when the mask was not applied). A position already
        consumed (a re-prefill after retraction) is ignored.
        """
        if self._matcher is None or self.rejected_token is not None:
            return self.rejected_token is not None
        if position < self.num_accepted:
            return False
        if self.in_reasoning:
            self.num_accepted = position + 1
            self.in_reasoning = token != self.think_end_id
            return False
        if not self._matcher.accept(token):
            logger.warning("grammar (%s) rejected token %d at output position %d", self.spec.kind, token, position)
            self.rejected_token = token
            return True
        self.num_accepted = position + 1
        return self._matcher.is_terminated()

    def end_reason(self, token: int) -> dict:
        """SGLang finish_reason once `advance` returned True for `token`."""
        if self.rejected_token is not None:
            return {"type": "abort", "message": f"the {self.spec.kind} constraint rejected token {token}"}
        return {"type": "stop", "matched": token}

    def release(self) -> None:
        """Drop the matcher (finish or abort); idempotent."""
        if not self.released:
            self.released = True
            if self._matcher is not None:
                self._matcher = None
                self._manager.matcher_released()
