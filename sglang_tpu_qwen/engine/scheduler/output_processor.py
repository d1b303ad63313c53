"""OutputProcessor: what a step's results do to its requests (SGLang's scheduler_output_processor_mixin.py).

Prompt logprobs of the positions a step computed, the sampled token of each row that finished its pending
tokens (output logprobs, detokenized text, grammar advance), the stop checks (stop token, stop string,
grammar end, max_new_tokens, context length) and streaming every --stream-interval tokens (each chunk the
increment since the previous one, `Request.reply`). Finishing a request (its memory, its final reply) is the
scheduler's `finish`, passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.observability.metrics import Metrics
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner, StepOutput
from sglang_tpu_qwen.engine.scheduler.schedule_batch import ScheduleBatch
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

Finish = Callable[[Request, dict], None]


class OutputProcessor:
    """Turns a step's device results into request state and replies (see the module docstring)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, args: ServerArgs, context_length: int,
                 eos_ids: Collection[int], metrics: Metrics | None, finish: Finish) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.args = args
        self.context_length = context_length
        self.eos_ids = eos_ids
        self.metrics = metrics
        self.finish = finish

    # ---- prompt logprobs -----------------------------------------------------------------------
    def input_logprobs(self, batch: ScheduleBatch, step: StepOutput) -> None:
        """Prompt logprobs from logprob_start_len, gathered for the positions this step computed.

        Runs before the step advances cached_len (positions are relative to it).
        """
        rows, cols, targets, owners = [], [], [], []
        num_top = 0
        for r, n, i in zip(batch.reqs, batch.extend_lens, batch.rows, strict=True):
            if not r.return_logprob or r.input_logprobs_done:
                continue
            prompt = r.prompt_ids
            if r.cached_len <= r.logprob_start_len == 0 and not r.input_token_logprobs:
                r.input_token_logprobs.append([None, prompt[0], self._tok_text(r, prompt[0])])
                r.input_top_logprobs.append(None)
            # Position j predicts token j + 1; keep targets in [max(start, 1), len(prompt)).
            for j in range(r.cached_len, r.cached_len + n):
                target = j + 1
                if max(r.logprob_start_len, 1) <= target < len(prompt):
                    rows.append(i)
                    cols.append(j - r.cached_len)
                    targets.append(prompt[target])
                    owners.append(r)
            num_top = max(num_top, r.top_logprobs_num)
            if r.cached_len + n >= len(prompt):
                r.input_logprobs_done = True
        if not rows:
            return
        lp, top_lp, top_ids = self.runner.logprobs_at(step, np.array(rows), np.array(cols), np.array(targets),
                                                      num_top)
        for k, r in enumerate(owners):
            r.input_token_logprobs.append([float(lp[k]), targets[k], self._tok_text(r, targets[k])])
            if r.top_logprobs_num:
                r.input_top_logprobs.append(self._top_list(r, top_lp[k], top_ids[k]))

    # ---- sampled tokens ------------------------------------------------------------------------
    def process_sampled(self, batch: ScheduleBatch, sampled: tuple[np.ndarray, ...] | None) -> None:
        """Accept the sampled token of every finishing row; a scoring-only request (max_new_tokens 0) ends.

        sampled: host (tokens [B], logprob [B], top_logprobs [B, K], top_ids [B, K]) or None when the batch
        sampled nothing (batch.sampling is None). Clears the rows' tokens_in_flight; a request finished since
        the step was launched (overlap scheduling computed one token past its end, or an abort) ignores it.
        """
        now = time.perf_counter()
        for r in batch.sampling_reqs:
            r.tokens_in_flight -= 1
        # Python ints and floats once for the whole batch (indexing numpy per row costs more, every step).
        toks, lps = (None, None) if sampled is None else (sampled[0].tolist(), sampled[1].tolist())
        for i in batch.finishing:
            r, row = batch.reqs[i], batch.rows[i]
            if r.finished:  # finished while this step ran (overlap: one step late; abort): token discarded
                continue
            if r.max_new_tokens == 0 or sampled is None:  # scoring only: the prompt's logprobs are the answer
                self.finish(r, {"type": "length", "length": 0})
                continue
            assert toks is not None and lps is not None
            top = (sampled[2][row], sampled[3][row]) if r.top_logprobs_num else (None, None)
            self.accept_token(r, toks[row], lps[row], *top, now)

    def accept_token(self, r: Request, tok: int, lp: float, top_lp: Any, top_ids: Any, now: float) -> None:
        """Append one sampled token to r (logprobs, text, grammar), then finish or stream per the stop rules.

        top_lp / top_ids: the row's top alternatives ([K] arrays or lists, K >= r.top_logprobs_num; read only
        when r.top_logprobs_num > 0).
        """
        if r.first_token_time is None:
            r.first_token_time = now
            if self.metrics:
                self.metrics.on_first_token(now - r.created)
        elif self.metrics and r.last_token_time is not None:
            self.metrics.on_decode_token(now - r.last_token_time)
        r.last_token_time = now
        r.append_token(tok)
        if r.return_logprob:
            r.output_token_logprobs.append([lp, tok, self._tok_text(r, tok)])
            if r.top_logprobs_num:
                r.output_top_logprobs.append(self._top_list(r, top_lp[: r.top_logprobs_num],
                                                            top_ids[: r.top_logprobs_num]))
        sp = r.params
        stop_token = sp.is_stop_token(tok, self.eos_ids) and len(r.output_ids) >= sp.min_new_tokens
        # A matched stop token stays in output_ids but not in the text, as SGLang's detokenizer trims it
        # (trim_matched_stop), unless no_stop_trim.
        if not stop_token or sp.no_stop_trim:
            if r.stream or r.detokenizer.stop:
                r.add_text(r.detokenizer.push([tok]))
            else:  # nothing reads the text before the end: decoded once by the scheduler's finish
                r.detokenizer.append([tok])
        if r.grammar is not None and r.grammar.advance(tok, len(r.output_ids) - 1):
            self.finish(r, r.grammar.end_reason(tok))  # a stop token where the grammar may end
            return
        if stop_token:
            self.finish(r, {"type": "stop", "matched": tok})
        elif r.detokenizer.stopped:
            self.finish(r, {"type": "stop", "matched": r.detokenizer.matched_stop})
        elif len(r.output_ids) >= r.max_new_tokens or len(r.fill_ids) >= self.context_length:
            self.finish(r, {"type": "length", "length": len(r.output_ids)})
        elif r.stream and len(r.output_ids) - r.streamed_upto >= self.args.stream_interval:
            r.sink(r.reply())  # the increment since the previous chunk (Request.reply advances streamed_upto)

    # ---- text ----------------------------------------------------------------------------------
    def _tok_text(self, r: Request, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if r.return_text_in_logprobs else None

    def _top_list(self, r: Request, vals: Any, ids: Any) -> list[list[Any]]:
        return [[float(v), int(t), self._tok_text(r, int(t))] for v, t in zip(vals, ids, strict=True)]
