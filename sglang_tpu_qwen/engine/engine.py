"""Engine: the in-process API (SGLang's `sgl.Engine` shape) over the scheduler thread.

`generate` / `async_generate` take SGLang's GenerateReqInput fields, validate them, split a batch
(and `n` > 1) into one Request per sample, and return SGLang's reply dicts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
from sglang_tpu_qwen.engine.io.errors import InvalidRequestError, RequestFailedError, failed_status
from sglang_tpu_qwen.engine.io.multimodal import ImageItem
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.io.request_images import Encode, RequestImages
from sglang_tpu_qwen.engine.io.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from sglang_tpu_qwen.engine.observability.health import HealthSnapshot
from sglang_tpu_qwen.engine.observability.metrics import Metrics
from sglang_tpu_qwen.engine.observability.profiler import ProfileConfig
from sglang_tpu_qwen.engine.platform_report import log_platform
from sglang_tpu_qwen.engine.runner import compilation
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
from sglang_tpu_qwen.engine.runner.sampler import TOP_LOGPROBS_MAX
from sglang_tpu_qwen.engine.runner.sizing import resolve_device_defaults
from sglang_tpu_qwen.engine.scheduler.scheduler import Scheduler
from sglang_tpu_qwen.grammar.manager import create_grammar_manager
from sglang_tpu_qwen.grammar.spec import CONSTRAINT_KEYS, GrammarSpec
from sglang_tpu_qwen.grammar.whitespace import resolve_json_whitespace
from sglang_tpu_qwen.memory.host_budget import resolve_host_tier
from sglang_tpu_qwen.parsers.markers import THINK_END
from sglang_tpu_qwen.tokenizer.detokenizer import IncrementalDetokenizer
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)

# Sequences (prompts x n) one call may create: each holds host state until it finishes.
MAX_SEQUENCES_PER_CALL = 1024


class ServingRole(Protocol):
    """What the engine holds of a prefill/decode disaggregation role (disagg/roles.py builds it)."""

    def attach(self, reqs: list[Request], host: Any, port: Any, room: Any) -> None:
        """Turn a call's requests into transfer legs; raises InvalidRequestError on bad bootstrap fields."""

    def reject_call(self, text: Any, input_ids: Any, sampling_params: Any, room: Any, message: str) -> None:
        """A call refused before it became requests: fail the rooms it would have used."""

    def stats(self) -> dict[str, Any]:
        """Transfer counters for /get_server_info and /metrics."""

    def shutdown(self) -> None:
        """Stop the role's transport."""


class Engine:
    """Load a Qwen3.5-MoE checkpoint and serve generate calls in process.

    Args:
      server_args: a ServerArgs; or keyword arguments with ServerArgs field names
        (`Engine(model_path=..., page_size=16)`); unknown names raise TypeError.
    Without `model_path` the embedded tiny checkpoint is built (once) and served.
    """

    def __init__(self, server_args: ServerArgs | None = None, *, devices: list[Any] | None = None,
                 role: Callable[[Engine], ServingRole | None] | None = None, image_encoder: Encode | None = None,
                 **kwargs: Any) -> None:
        """`devices`: the JAX devices to place weights and cache on (default: all, or device 0 without a
        mesh); disaggregation's colocated-split gives each of its two engines its own group.

        `role`: builds the serving role of --disaggregation-mode and hooks it into the scheduler before it
        starts (the launcher passes `disagg.roles.setup`; the engine does not import disagg/). Raises
        ValueError when --disaggregation-mode is not `null` and no role builder is given.

        `image_encoder`: for a vision-language checkpoint, the vision encoder's call (list of ImageItem ->
        per image [num_tokens, hidden] arrays, engine/io/request_images.py); default the checkpoint's
        VisionEncoder (engine/runner/vision_setup.py). Without either, requests with images are refused (400).
        ValueError for a text-only checkpoint.
        """
        self.server_args = server_args or ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        if args.tp_size > 1:
            raise ValueError("--tp-size > 1 is not implemented: attention is data-parallel (--dp-size) and "
                             "experts expert-parallel (--ep-size)")
        if args.nnodes > 1:
            raise ValueError("serving across hosts (--nnodes > 1) is not implemented yet; the mesh and the "
                             "sharded forward support it (parallel/multihost.py), the scheduler does not")
        # The platform and its devices, and a loud warning when a TPU is present but JAX runs on the CPU.
        log_platform(logger, devices)
        self.model_path = args.model_path or str(ensure_embedded_model())
        self.tokenizer_path = args.tokenizer_path or self.model_path
        self.served_model_name = args.served_model_name or self.model_path
        self.tokenizer = Tokenizer(self.tokenizer_path)
        # Whether generate calls may carry images (`images`): a vision checkpoint with its encoder (set below).
        self.accepts_images = False
        resolve_device_defaults(args, devices)  # once, before the runner (which reads the flags, never sets them)
        self.host_tier = resolve_host_tier(args)  # --gdn-snapshot-host-gb's default, from host memory
        # Loading, building and precompiling compile programs; with another engine of this process already
        # serving (colocated-split) they are not late compiles (engine/runner/compilation.py).
        with compilation.precompiling():
            self.runner = ModelRunner.from_checkpoint(self.model_path, args, devices=devices)
            self.model_config = self.runner.config
            self.context_length = self.runner.sizing.context_length
            self.metrics = Metrics() if args.enable_metrics else None
            self.scheduler = Scheduler(self.runner, self.tokenizer, args, self.context_length, self.metrics)
            # The encoder: the caller's (tests pass HF's tower), else the checkpoint's VisionEncoder.
            vision = self.runner.vision_encoder
            if image_encoder is None and vision is not None and self.model_config.has_vision:
                image_encoder = vision.encode
            if image_encoder is not None:
                self.scheduler.set_image_encoder(image_encoder)
            self.image_encoder = image_encoder
            self.accepts_images = image_encoder is not None
            self._seed_counter = itertools.count(args.random_seed * 1_000_003 + 1)
            if args.disaggregation_mode != "null" and role is None:
                raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} needs its role: build the engine "
                                 "with role=disagg.roles.setup (launch_server does)")
            self.disagg = role(self) if role is not None else None  # PD: the scheduler's hooks, its transport
            # Every step shape and sampling program, before the server can report ready (engine/runner/buckets.py).
            self.precompile_stats = None if args.disable_precompile else self.runner.precompile()
        # Constrained decoding; the backend (xgrammar imports torch: seconds of CPU) loads on a background
        # thread, started after the precompile so it does not take a core from the compiler; a grammar
        # request that comes before it finishes waits for it.
        self.grammar = create_grammar_manager(
            args.grammar_backend, self.tokenizer, self.model_config.vocab_size,
            set(self.model_config.eos_token_id) | set(self.tokenizer.eos_token_ids),
            any_whitespace=resolve_json_whitespace(args.constrained_json_whitespace_pattern,
                                                   args.constrained_json_disable_any_whitespace, args.grammar_backend))
        if self.metrics is not None:  # cache, snapshot and PD counters, read at each scrape
            spec = self.scheduler.spec
            self.metrics.watch(self.scheduler.memory_usage, lambda: self.disagg.stats() if self.disagg else None,
                               lambda: (len(self.scheduler.running), len(self.scheduler.waiting)),
                               spec.info if spec is not None else lambda: None)
        self.scheduler.start()

    # ---- request building ----------------------------------------------------------------------
    def _build(
        self, text: Any, input_ids: Any, sampling_params: Any, return_logprob: Any, logprob_start_len: Any,
        top_logprobs_num: Any, return_text_in_logprobs: bool, stream: bool, rid: Any,
        sink: Callable[[dict], None], require_reasoning: bool = False, images: Any = None,
    ) -> tuple[list[Request], bool]:
        """Validate a GenerateReqInput and make one Request per (prompt, sample); returns (requests, is_batch)."""
        if (text is None) == (input_ids is None):
            raise InvalidRequestError("Either text or input_ids should be provided (exactly one).")
        if _has_images(images) and not self.accepts_images:
            raise InvalidRequestError("this model does not accept images")
        if text is not None:
            is_batch = isinstance(text, list)
            texts = text if is_batch else [text]
            if not texts:
                raise InvalidRequestError("text is an empty list")
            prompts = []
            for t in texts:
                if not isinstance(t, str):
                    raise InvalidRequestError("text must be a string or a list of strings")
                if not t:
                    raise InvalidRequestError("The input text is empty.")
                prompts.append(self.tokenizer.encode(t))
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = input_ids if is_batch else [input_ids]
            if not isinstance(input_ids, list) or not prompts:
                raise InvalidRequestError("input_ids must be a list of token ids or a list of such lists")
        n_prompts = len(prompts)
        per_prompt_images = self._images_per_prompt(images, prompts, is_batch)

        def per_item(value: Any, name: str) -> list[Any]:
            if isinstance(value, list) and is_batch:
                if len(value) != n_prompts:
                    raise InvalidRequestError(f"{name} has {len(value)} entries for {n_prompts} prompts")
                return value
            return [value] * n_prompts

        sps = per_item(sampling_params, "sampling_params")
        lps, starts = per_item(return_logprob, "return_logprob"), per_item(logprob_start_len, "logprob_start_len")
        tops = per_item(top_logprobs_num, "top_logprobs_num")
        rids = rid if isinstance(rid, list) else [None] * n_prompts if rid is None or is_batch else [rid]
        if is_batch and isinstance(rid, str):
            raise InvalidRequestError("rid must be a list for a batch request")
        if len(rids) != n_prompts:
            raise InvalidRequestError(f"rid has {len(rids)} entries for {n_prompts} prompts")

        # SGLang's require_reasoning: the output starts inside the reasoning; a grammar waits for its end.
        think_end = self.tokenizer.token_to_id(THINK_END) if require_reasoning else None
        reqs: list[Request] = []
        all_params = [SamplingParams.from_dict(sps[i]) for i in range(n_prompts)]
        total = sum(p.n for p in all_params)
        if total > MAX_SEQUENCES_PER_CALL:
            raise InvalidRequestError(f"The request makes {total} sequences (prompts x n); at most "
                                      f"{MAX_SEQUENCES_PER_CALL} are allowed per request.")
        for i, ids in enumerate(prompts):
            params = self._bound_params(all_params[i])
            spec = params.grammar_spec
            compiled = None if spec is None else self._check_grammar(spec)
            self.check_input_ids(ids)
            max_new = self._max_new_tokens(len(ids), params)
            start = starts[i]
            if start is None or start == -1 or not lps[i]:
                start = len(ids)  # no prompt logprobs unless asked for: keeps the whole prefix cacheable
            if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(ids):
                raise InvalidRequestError(f"logprob_start_len must be in [0, {len(ids)}] or -1, got {start}")
            params.check_vocab(self.model_config.vocab_size)
            top = tops[i] or 0
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= TOP_LOGPROBS_MAX:
                raise InvalidRequestError(f"top_logprobs_num must be in [0, {TOP_LOGPROBS_MAX}], got {top}")
            base_rid = rids[i] or uuid.uuid4().hex
            req_images = self._request_images(ids, per_prompt_images[i])
            for j in range(params.n):
                seed = next(self._seed_counter) if params.seed is None else params.seed + j
                reqs.append(Request(
                    rid=base_rid if params.n == 1 else f"{base_rid}::{j}",
                    index=len(reqs), prompt_ids=list(ids), params=params, max_new_tokens=max_new, seed=seed,
                    sink=sink, stream=stream, return_logprob=bool(lps[i]), logprob_start_len=start,
                    top_logprobs_num=top, return_text_in_logprobs=bool(return_text_in_logprobs),
                    detokenizer=IncrementalDetokenizer(self.tokenizer, stop=params.stop,
                                                       skip_special_tokens=params.skip_special_tokens,
                                                       trim_stop=not params.no_stop_trim),
                    grammar=None if compiled is None else self.grammar.request_grammar(spec, compiled, think_end),
                    images=req_images))
        return reqs, is_batch or len(reqs) > 1

    def _images_per_prompt(self, images: Any, prompts: list[Any], is_batch: bool) -> list[Any]:
        """`images` split per prompt: a list of ImageItem for one prompt, or one such list (or None) per prompt
        of a batch (InvalidRequestError otherwise, or when the model takes no images or has no encoder yet)."""
        per = [images] if not is_batch else images if images is not None else [None] * len(prompts)
        if not isinstance(per, list) or len(per) != len(prompts):
            raise InvalidRequestError(f"images must hold one list per prompt ({len(prompts)} prompts)")
        if any(per) and not self.accepts_images:
            raise InvalidRequestError("this model does not accept images")
        for items in per:
            if items and not (isinstance(items, list) and all(isinstance(im, ImageItem) for im in items)):
                raise InvalidRequestError("images must be a list of ImageItem per prompt")
        return per

    def _request_images(self, ids: list[int], items: list[ImageItem] | None) -> RequestImages | None:
        """A checked prompt's RequestImages (None without images); InvalidRequestError when its image pad tokens
        do not match its images (a vision model's prompt with pad tokens and no images included)."""
        config = self.model_config
        if not items:
            if config.has_vision and config.image_token_id in ids:
                raise InvalidRequestError("the prompt has image tokens but no images were given")
            return None
        assert config.image_token_id is not None
        try:
            return RequestImages(list(ids), list(items), config.image_token_id, config.vocab_size)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e

    def _check_grammar(self, spec: GrammarSpec) -> Future:
        """Validate a constraint now (a bad one raises GrammarError, an InvalidRequestError); returns the future
        of its compiled grammar, shared by the prompt's samples."""
        if self.grammar is None:
            raise InvalidRequestError(f"sampling_params.{spec.kind}: constrained decoding is off "
                                      "(--grammar-backend none)")
        return self.grammar.submit(spec)

    def check_input_ids(self, ids: Any) -> None:
        """Raise InvalidRequestError unless ids is a non-empty list of token ids (ints, not booleans, in
        [0, vocab_size)) that leaves room for at least one new token in the context and the KV pool."""
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list) or not ids:
            raise InvalidRequestError("The input is empty (no tokens).")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is out of range [0, {vocab})")
        if len(ids) >= self.context_length:
            raise InvalidRequestError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).")
        if len(ids) >= self.scheduler.kv_tokens_total:  # it could never be admitted: it would wait forever
            raise InvalidRequestError(
                f"The input ({len(ids)} tokens) is longer than the KV cache of this server "
                f"({self.scheduler.kv_tokens_total} tokens, --max-total-tokens).")

    def _bound_params(self, params: SamplingParams) -> SamplingParams:
        """Check the limits that need the model; returns params with top_k >= vocab_size as -1 (no cut: the
        same distribution, and the sampler's static top-k width stays within the vocabulary)."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}")
        if params.top_k >= vocab:
            params = dataclasses.replace(params, top_k=-1)
        return params

    def room_for(self, prompt_len: int) -> int:
        """Most new tokens a prompt of prompt_len tokens may ask for (context length and KV pool bound)."""
        return min(self.context_length, self.scheduler.kv_tokens_total) - prompt_len

    def _max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.room_for(prompt_len)
        if params.max_new_tokens is None:
            max_new = max(0, min(DEFAULT_MAX_NEW_TOKENS, room))
            if params.min_new_tokens > max_new:  # never capped silently: the caller asked for more
                raise InvalidRequestError(
                    f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {params.min_new_tokens}. "
                    "Set max_new_tokens to allow more tokens.")
            return max_new
        if params.max_new_tokens > room:
            raise InvalidRequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{min(self.context_length, self.scheduler.kv_tokens_total)} tokens. You requested a total of "
                f"{prompt_len + params.max_new_tokens} tokens: {prompt_len} tokens from the input messages and "
                f"{params.max_new_tokens} tokens for the completion.")
        return params.max_new_tokens

    # ---- public API ----------------------------------------------------------------------------
    async def async_generate(
        self, text: Any = None, input_ids: Any = None, sampling_params: Any = None,
        return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = 0,
        return_text_in_logprobs: bool = False, stream: bool = False, rid: Any = None,
        bootstrap_host: Any = None, bootstrap_port: Any = None, bootstrap_room: Any = None,
        require_reasoning: bool = False, stream_deltas: bool = False, images: Any = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """Generate; see docs/internals.md for the reply shapes. Raises InvalidRequestError on bad input.

        images: the prompt's images (engine/io/multimodal.py ImageItem), a list for one prompt or a list of lists
        for a batch, in the order of their pad-token runs in the prompt ids (sglang_tpu_qwen/multimodal expands
        them). Refused ("this model does not accept images") unless `accepts_images`.

        stream=True yields SGLang's cumulative chunks; with stream_deltas=True it yields the scheduler's
        increments instead (`Request.reply`: text, output_ids and output logprobs new since the previous chunk
        of that index), which the HTTP layer renders in time independent of the reply's length.

        require_reasoning (SGLang's field): the output starts inside the model's reasoning, so a constraint
        (regex, json_schema...) applies only after the reasoning's end token.

        bootstrap_*: prefill/decode disaggregation (SGLang's fields, injected by the PD router; disagg/).
        A request that ends aborted with a status code (a failed transfer) raises that error instead.
        """
        self._check_serving()
        if self.grammar is not None and not self.grammar.backend_loaded() and _has_constraint(sampling_params):
            await self.grammar.wait_loaded()  # it loads after the precompile; _build would block the loop on it
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[dict] = asyncio.Queue()
        try:
            reqs, is_batch = self._build(text, input_ids, sampling_params, return_logprob, logprob_start_len,
                                         top_logprobs_num, return_text_in_logprobs, stream, rid,
                                         lambda d: loop.call_soon_threadsafe(out.put_nowait, d),
                                         require_reasoning=bool(require_reasoning), images=images)
            if self.disagg is not None:
                self.disagg.attach(reqs, bootstrap_host, bootstrap_port, bootstrap_room)
        except InvalidRequestError as e:  # a prefill server tells the decode legs waiting on these rooms
            if self.disagg is not None:
                self.disagg.reject_call(text, input_ids, sampling_params, bootstrap_room, str(e))
            raise
        if self.metrics:
            for _ in reqs:
                self.metrics.on_request_start()
        self.scheduler.submit(reqs)
        if stream:
            return self._stream_async(reqs, out, stream_deltas)
        try:
            finals = await _collect(out, len(reqs))
        except BaseException:  # cancelled: the client went away
            self._abort_all(reqs)
            raise
        for d in finals:
            _raise_on_status(d)
        return finals if is_batch else finals[0]

    async def _stream_async(self, reqs: list[Request], out: asyncio.Queue[dict],
                            deltas: bool) -> AsyncIterator[dict]:
        remaining = len(reqs)
        first = True
        shape: Callable[[dict], dict] = (lambda d: d) if deltas else _Cumulative()
        try:
            while remaining:
                chunk = await out.get()
                if chunk["meta_info"]["finish_reason"] is not None:
                    remaining -= 1
                if first:  # still before the HTTP status is sent: a failed transfer becomes its error
                    _raise_on_status(chunk)
                    first = False
                yield shape(chunk)
        finally:
            if remaining:
                self._abort_all(reqs)

    def generate(
        self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
        return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = 0,
        return_text_in_logprobs: bool = False, stream: bool = False, rid: Any = None, stream_deltas: bool = False,
        images: Any = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Synchronous twin of async_generate (`prompt` is SGLang Engine's name for text).

        Raises as async_generate does: InvalidRequestError on bad input, and for a request the server failed
        (a reply aborted with a status code) its error (RequestFailedError...), for a stream at its first
        chunk; a client abort is an ordinary reply.
        """
        self._check_serving()
        out: queue.Queue[dict] = queue.Queue()
        reqs, is_batch = self._build(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                     top_logprobs_num, return_text_in_logprobs, stream, rid, out.put, images=images)
        if self.metrics:
            for _ in reqs:
                self.metrics.on_request_start()
        self.scheduler.submit(reqs)
        if stream:
            return self._stream_sync(reqs, out, stream_deltas)
        finals: dict[int, dict] = {}
        while len(finals) < len(reqs):
            d = out.get()
            if d["meta_info"]["finish_reason"] is not None:
                finals[d["index"]] = d
        ordered = [finals[i] for i in range(len(reqs))]
        for d in ordered:
            _raise_on_status(d)
        return ordered if is_batch else ordered[0]

    def _stream_sync(self, reqs: list[Request], out: queue.Queue[dict], deltas: bool) -> Iterator[dict]:
        remaining = len(reqs)
        first = True
        shape: Callable[[dict], dict] = (lambda d: d) if deltas else _Cumulative()
        try:
            while remaining:
                d = out.get()
                if d["meta_info"]["finish_reason"] is not None:
                    remaining -= 1
                if first:  # as _stream_async: a request failed before its first chunk raises its error
                    _raise_on_status(d)
                    first = False
                yield shape(d)
        finally:
            if remaining:
                self._abort_all(reqs)

    def health(self) -> HealthSnapshot:
        """The scheduler's health (engine/observability/health.py); `/health` reports its
        `problem(--watchdog-timeout)`."""
        return self.scheduler.health()

    def set_warmed_up(self, value: bool) -> None:
        """launch_server clears this before its warm-up request and sets it once the request passed."""
        self.scheduler.health_state.warmed_up = value

    def _check_serving(self) -> None:
        """Refuse new requests (503) when the scheduler cannot run them: they would wait forever."""
        snap = self.health()
        if not snap.alive or snap.fatal_error is not None:
            raise RequestFailedError(f"The server cannot serve requests: "
                                     f"{snap.fatal_error or 'the scheduler is not running'}", 503,
                                     "ServiceUnavailable")

    def _abort_all(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.aborted = True
            self.scheduler.abort(r.rid)

    def abort(self, rid: str) -> None:
        """Abort a request (all its samples when n > 1); its memory is freed at the next step."""
        self.scheduler.abort(rid)

    def abort_all(self) -> None:
        """Abort every waiting and running request."""
        self.scheduler.abort(None)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests are waiting or running."""
        return self.scheduler.flush_cache()

    def start_profile(self, body: dict[str, Any] | None = None) -> Future:
        """Start a jax.profiler trace of the scheduler's steps (SGLang's /start_profile fields;
        engine/observability/profiler.py).

        Returns a Future of the reply text, set by the scheduler thread between two steps. Raises ProfileError
        (an InvalidRequestError) for a bad field or when a trace is already pending or running."""
        return self.scheduler.profiler.request_start(ProfileConfig.from_body(body))

    def stop_profile(self) -> Future:
        """Stop the trace and write its files; a Future of the reply text. Raises ProfileError when none runs."""
        return self.scheduler.profiler.request_stop()

    def get_server_info(self) -> dict[str, Any]:
        spec = self.scheduler.spec
        info = dataclasses.asdict(self.server_args)
        info.update({
            "model_path": self.model_path,
            "context_length": self.context_length,
            # The resolved --mamba-ssm-dtype (the flag, else the checkpoint's): the GDN state's storage dtype.
            "mamba_ssm_dtype": self.runner.sizing.state_dtype.name,
            "memory": self.scheduler.memory_usage(),
            # SGLang's place for it: one internal state per device, memory_usage in GB (memory_accounting.py).
            # SGLang's place for avg_spec_accept_length (speculative decoding: engine/scheduler/speculative.py).
            "internal_states": [{"memory_usage": usage, **(spec.info() if spec is not None else {})}
                                for usage in self.runner.memory_usage],
            # How each DP rank's memory was split between GDN slots and KV pages, and the rule that decided.
            "memory_split": self.runner.sizing.split.as_dict(),
            # The compiled programs' largest temporaries (XLA's memory analysis), read after precompile; None
            # when precompile was skipped (engine/runner/program_memory.py).
            "program_memory": None if self.runner.program_memory is None else self.runner.program_memory.as_dict(),
            # The vision tower's bytes (out of the budget before the split), buckets and counters; None: text-only.
            "vision_encoder": self.runner.vision_info(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "version": _version(),
            "jit_compilations": compilation.jit_compilations(),
            "jit_compilations_from_cache": compilation.cache_hits(),
            "precompile": self.precompile_stats,
            # How --gdn-snapshot-host-gb was set (memory/host_budget.py); usage is under "memory".
            "gdn_snapshot_host_tier": self.host_tier.as_dict(),
        })
        if self.disagg is not None:
            info["disaggregation"] = self.disagg.stats()
        info["health"] = dataclasses.asdict(self.health())
        return info

    def shutdown(self) -> None:
        if self.disagg is not None:
            self.disagg.shutdown()
        stopped = self.scheduler.shutdown()
        if not stopped:  # a step still runs on the device arrays: they are left to the garbage collector
            logger.warning("the scheduler thread did not stop within 30 s; the device memory is not freed now")
        self.runner.close(free_device_memory=stopped)
        if self.grammar is not None:
            self.grammar.shutdown()


def _has_images(images: Any) -> bool:
    """True when `images` (one prompt's list, or a batch's list of lists) holds at least one image."""
    if isinstance(images, (list, tuple)):
        return any(_has_images(i) for i in images)
    return images is not None


def _has_constraint(sampling_params: Any) -> bool:
    """Whether a request's sampling_params (a dict, or a list of them for a batch) name a constraint."""
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    return any(isinstance(p, dict) and any(p.get(k) is not None for k in CONSTRAINT_KEYS) for p in items)


class _Cumulative:
    """Turns a stream's increments back into SGLang's cumulative chunks (the Engine API's stream=True).

    Each chunk of an index gets all text, output_ids and output logprobs of that index so far (O(reply
    length) per chunk, as in SGLang's tokenizer manager; the HTTP layer takes the increments instead).
    """

    def __init__(self) -> None:
        self._so_far: dict[int, tuple[list[str], list[int], dict[str, list]]] = {}

    def __call__(self, chunk: dict) -> dict:
        text, ids, lps = self._so_far.setdefault(chunk["index"], ([], [], {}))
        text.append(chunk["text"])
        ids.extend(chunk["output_ids"])
        meta = dict(chunk["meta_info"])
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                lps.setdefault(key, []).extend(meta[key])
                meta[key] = list(lps[key])
        return {**chunk, "text": "".join(text), "output_ids": list(ids), "meta_info": meta}


def _raise_on_status(reply: dict) -> None:
    """SGLang's rule: a reply aborted with a status_code is that HTTP error (a failed step or PD transfer).

    Raises InvalidRequestError for 400, TransferError for a PD transfer failure (no err_type), otherwise
    RequestFailedError with the status and err_type; returns for any other reply (a client abort included).
    """
    reason = reply["meta_info"]["finish_reason"] or {}
    status = failed_status(reason)
    if status is None:
        return
    if status == 400:
        raise InvalidRequestError(str(reason.get("message")))
    if "err_type" not in reason:
        raise TransferError(str(reason.get("message")), status)
    raise RequestFailedError(str(reason.get("message")), status, str(reason["err_type"]))


async def _collect(out: asyncio.Queue[dict], count: int) -> list[dict]:
    finals: dict[int, dict] = {}
    while len(finals) < count:
        d = await out.get()
        if d["meta_info"]["finish_reason"] is not None:
            finals[d["index"]] = d
    return [finals[i] for i in range(count)]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-tpu-qwen")
    except PackageNotFoundError:
        return "0.0.0+local"
