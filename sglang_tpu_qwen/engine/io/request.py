"""Request: the scheduler's state for one sequence (one sample of one prompt)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_tpu_qwen.engine.io.sampling_params import SamplingParams
from sglang_tpu_qwen.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.io.request_images import RequestImages
    from sglang_tpu_qwen.grammar.request_grammar import RequestGrammar

Logprob = list[Any]  # [logprob | None, token_id, text | None], SGLang's triple


@dataclass
class Request:
    """One sequence from arrival to finish.

    `fill_ids` (prompt + output so far, one list that `append_token` extends) is what the model must have
    seen; `cached_len` of them are in the request's KV pages and GDN slot. A step feeds
    fill_ids[cached_len:] (a prefill chunk, or the one last sampled token in decode). Retraction frees the
    memory and sets cached_len to 0; the request later re-prefills prompt + output and goes on where it
    stopped.
    """

    rid: str
    index: int  # position in the caller's batch (prompt-major, then sample)
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    seed: int
    sink: Callable[[dict], None]  # called from the scheduler thread with each reply dict
    detokenizer: IncrementalDetokenizer
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = 0
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    # The decoded text as pieces (add_text appends one): `text` joins them, a stream chunk joins only its new
    # ones, so no per-token or per-chunk work grows with the reply (a str attribute's += copies all of it).
    text_pieces: list[str] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    rank: int = 0  # data-parallel attention rank holding pages and slot (scheduler.py, rank_memory.py)
    cached_len: int = 0
    admit_order: int = 0
    # Prefix cache (engine/scheduler/prefix_cache.py): pages[:num_tree_pages] belong to the tree, locked via
    # prefix_node.
    prefix_node: Any = None
    num_tree_pages: int = 0
    snapshot_targets: list[int] = field(default_factory=list)
    private_snapshot: tuple[int, int] | None = None  # (snapshot slot, position) taken during decode
    cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    input_logprobs_done: bool = False
    input_token_logprobs: list[Logprob] = field(default_factory=list)
    input_top_logprobs: list[list[Logprob] | None] = field(default_factory=list)
    output_token_logprobs: list[Logprob] = field(default_factory=list)
    output_top_logprobs: list[list[Logprob] | None] = field(default_factory=list)
    finish_reason: dict | None = None
    aborted: bool = False
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    streamed_upto: int = 0  # output tokens already sent in a stream chunk
    streamed_pieces: int = 0  # text_pieces already sent in a stream chunk
    # Constrained decoding: the request's grammar state (grammar/request_grammar.py), None when unconstrained.
    grammar: RequestGrammar | None = None
    # Prefill/decode disaggregation: this sequence's transfer leg (disagg/prefill.py, disagg/decode.py) or None.
    disagg: Any = None
    fill_ids: list[int] = field(init=False)  # prompt_ids + output_ids, kept in step by append_token
    # Overlap scheduling: sampled tokens still on the device (0 or 1); the next decode step reads it there.
    tokens_in_flight: int = 0
    # Images (engine/io/request_images.py): positions, cache keys and embeddings; None for a text request.
    images: RequestImages | None = None
    # Speculative decoding (engine/scheduler/speculative.py): the MTP layer's drafts for the next verify step,
    # and SGLang's counters (verify steps this request ran in, draft tokens they accepted).
    draft_tokens: list[int] = field(default_factory=list)
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    # Per-draft-token acceptance rate, a moving average of the request's draft-vs-target comparisons (adaptive
    # drafting: engine/scheduler/speculative.py); starts at SpecDecoder's prior.
    spec_alpha: float | None = None
    # Tokens the verify step in flight fed for this request (0: none): what it yields is not read yet, and the
    # next verify step takes its tokens from the device (overlap scheduling).
    verify_fed: int = 0
    # The verify step in flight may write this request's private decode snapshot (a page boundary inside its
    # fed tokens): until read, the snapshot slot's content is not the one recorded in private_snapshot.
    snapshot_pending: bool = False

    def __post_init__(self) -> None:
        self.fill_ids = self.prompt_ids + self.output_ids

    def append_token(self, token: int) -> None:
        """Add one generated token (to output_ids and fill_ids; never append to either directly)."""
        self.output_ids.append(token)
        self.fill_ids.append(token)

    @property
    def radix_ids(self) -> list[int]:
        """fill_ids as the prefix cache keys them: image pad tokens replaced by their image's hash-derived ids."""
        if self.images is None:
            return self.fill_ids
        return self.images.key_ids + self.output_ids

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next token can be sampled (a token in flight counts)."""
        return len(self.fill_ids) + self.tokens_in_flight - self.cached_len

    @property
    def num_output(self) -> int:
        """Output tokens including the one in flight (sampling steps and length limits count it)."""
        return len(self.output_ids) + self.tokens_in_flight

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All decoded text so far (joins text_pieces: read it at the end, not per token)."""
        return "".join(self.text_pieces)

    def add_text(self, piece: str) -> None:
        """Append newly decoded text (O(1))."""
        if piece:
            self.text_pieces.append(piece)

    def reply(self) -> dict:
        """SGLang's reply dict {"text", "output_ids", "meta_info", "index"}.

        A request that does not stream gets its whole text, output ids and output logprobs. A streamed one
        gets the increment since its previous reply (SGLang's detokenizer sends increments too): text,
        output_ids, output_token_logprobs and output_top_logprobs new since then, so a chunk costs the same at
        token 4,000 as at token 10. Counts in meta_info (completion_tokens) are totals; input logprobs (fixed
        once the first token exists) are whole in every reply.
        """
        if not self.stream:
            return self._reply(self.text, list(self.output_ids), self.output_token_logprobs,
                               self.output_top_logprobs)
        start = self.streamed_upto
        new_text = "".join(self.text_pieces[self.streamed_pieces:])
        self.streamed_pieces = len(self.text_pieces)
        self.streamed_upto = len(self.output_ids)
        return self._reply(new_text, self.output_ids[start:], self.output_token_logprobs[start:],
                           self.output_top_logprobs[start:])

    def _reply(self, text: str, output_ids: list[int], token_lps: list[Logprob],
               top_lps: list[list[Logprob] | None]) -> dict:
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens or 0,
            "finish_reason": self.finish_reason,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.spec_verify_ct:  # SGLang's meta_info field under speculative decoding
            meta["spec_verify_ct"] = self.spec_verify_ct
        if self.return_logprob:
            meta["input_token_logprobs"] = list(self.input_token_logprobs)
            meta["output_token_logprobs"] = list(token_lps)
            if self.top_logprobs_num > 0:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = list(top_lps)
        return {"text": text, "output_ids": output_ids, "meta_info": meta, "index": self.index}
