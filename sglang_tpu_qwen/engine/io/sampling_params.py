"""SamplingParams: SGLang's `sampling_params` request field, validated."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.engine.runner.sampler import BAN_WIDTH, LOGIT_BIAS_MAX
from sglang_tpu_qwen.grammar.spec import CONSTRAINT_KEYS, GrammarSpec, spec_from_fields

DEFAULT_MAX_NEW_TOKENS = 128
# With the EOS ids (a few), stop_token_ids must fit sampler.BAN_WIDTH: all are banned before min_new_tokens.
MAX_STOP_TOKEN_IDS = BAN_WIDTH - 16
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Samples per prompt: OpenAI's own limit for `n`. Each sample is a sequence with its own GDN slot, so an
# unbounded n would let one request queue millions of sequences (and their host state).
MAX_N = 128
MAX_STOP_STRINGS = 64
# SGLang's _SAMPLING_EPS: a temperature below it samples greedily (dividing by it would overflow).
SAMPLING_EPS = 1e-6


@dataclass
class SamplingParams:
    """Per-request sampling settings, with SGLang's names and defaults.

    temperature 0 means greedy. top_k -1 (or 0) means no top-k cut. `seed` (SGLang: sampling_seed)
    makes a sampled request reproducible whatever else is in its batch. `spaces_between_special_tokens`
    is honoured as HF transformers honours it for this model's (byte-level BPE) tokenizer: special tokens
    decode without added spaces either way (tests/test_bad_input.py checks the text against HF's decode).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # Constrained decoding (sglang_tpu_qwen/grammar): at most one; json_schema / structural_tag as JSON text.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # SGLang's / OpenAI's logit_bias: token id (a decimal string in JSON) -> added to that logit, in
    # [-100, 100]; normalised by validate() to int keys. Applied after penalties, before the
    # min_new_tokens bans (engine/runner/sampler.py); at most LOGIT_BIAS_MAX entries.
    logit_bias: dict[int, float] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's dict; raises InvalidRequestError on unknown keys or bad values."""
        d = dict(d or {})
        if "sampling_seed" in d:
            d["seed"] = d.pop("sampling_seed")
        try:  # at most one constraint; a dict json_schema becomes its JSON text
            spec = spec_from_fields(d)
        except ValueError as e:
            raise InvalidRequestError(f"sampling_params: {e}") from None
        if spec is not None:
            d[spec.kind] = spec.text
        # SGLang accepts these; with no effect here, dropping them keeps SGLang clients working.
        for ignored in ("custom_params", "stream_interval"):
            d.pop(ignored, None)
        # The SGLang frontend sends stop_regex with every gen (an empty list unless set).
        if d.pop("stop_regex", None):
            raise InvalidRequestError("sampling_params.stop_regex is not supported by this server")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if v is not None}
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        try:
            params = cls(**d)
        except TypeError as e:
            raise InvalidRequestError(f"bad sampling_params: {e}") from None
        params.validate()
        return params

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad value (SGLang's message where SGLang has one).

        Every value is checked against the type it ends in on device: integers against int32
        (top_k, min/max_new_tokens, stop_token_ids), floats against float32 (a finite float64 such as 1e39
        would become inf), the seed against int64 (SGLang's range). Limits that need the model or the
        server (vocabulary, context length, top_k above the vocabulary) are checked by the engine.
        """

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:  # finite in float32: NaN or inf would silently turn the logits into junk
            return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                    and abs(x) <= FLOAT32_MAX)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not is_num(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("min_new_tokens", "top_k", "n"):
            if not is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None and not is_int(self.max_new_tokens):
            bad(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad(f"max_new_tokens must be at least 0, got {self.max_new_tokens!r}.")
        if self.max_new_tokens is not None and self.max_new_tokens > INT32_MAX:
            bad(f"max_new_tokens must be at most {INT32_MAX}, got {self.max_new_tokens}.")
        if self.temperature < 0:
            bad(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0 or self.top_k > INT32_MAX:  # SGLang's rule, in int32
            bad(f"top_k must be -1 (disable) or at least 1 (at most {INT32_MAX}), got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0 <= self.min_new_tokens <= INT32_MAX:
            bad(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got "
                f"{self.min_new_tokens}.")
        if not 1 <= self.n <= MAX_N:
            bad(f"n must be in [1, {MAX_N}], got {self.n}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids
        ):
            bad("stop_token_ids must be a list of non-negative integers")
        if self.seed is not None and not is_int(self.seed):
            bad(f"sampling_seed must be an integer, got {type(self.seed).__name__}.")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1:
            bad(f"sampling_seed must be in [-2**63, 2**63 - 1], got {self.seed}.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        self.logit_bias = self._checked_logit_bias(bad, is_num)

    def _checked_logit_bias(self, bad: Any, is_num: Any) -> dict[int, float] | None:
        """logit_bias with int keys; bad() on a non-integer key, a negative id, a value that is not a finite
        number in [-100, 100] (OpenAI's range), or more than LOGIT_BIAS_MAX entries. Ids beyond the
        vocabulary are checked by the engine, which knows its size (check_vocab)."""
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must be an object mapping token ids to numbers, got {self.logit_bias!r}")
        if len(self.logit_bias) > LOGIT_BIAS_MAX:
            bad(f"logit_bias has {len(self.logit_bias)} entries; at most {LOGIT_BIAS_MAX}")
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                tid = int(key) if not isinstance(key, bool) else None
            except (TypeError, ValueError):
                tid = None
            if tid is None or str(tid) != str(key).strip() or tid < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not is_num(value) or not -100.0 <= value <= 100.0:
                bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}")
            out[int(tid)] = float(value)  # type: ignore[arg-type]
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError when a logit_bias or stop_token_ids id is outside [0, vocab_size)."""
        for tid in [*(self.logit_bias or {}), *self.stop_token_ids]:
            if tid >= vocab_size:
                raise InvalidRequestError(f"token id {tid} in logit_bias / stop_token_ids is out of range "
                                          f"[0, {vocab_size})")

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The output constraint (regex / json_schema / ebnf / structural_tag), None when unconstrained."""
        return spec_from_fields({k: getattr(self, k) for k in CONSTRAINT_KEYS})

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def is_stop_token(self, token: int, eos_ids: Collection[int]) -> bool:
        """Whether `token` ends this request: one of stop_token_ids or EOS; none with ignore_eos (SGLang's
        rule: ignore_eos disables stop_token_ids too). Checked for every sampled token, so no set is built."""
        return not self.ignore_eos and (token in eos_ids or token in self.stop_token_ids)

    @property
    def bans_stop_tokens(self) -> bool:
        """Whether min_new_tokens bans ids while it lasts: stop_token_ids, or the EOS ids unless ignore_eos
        (schedule_batch.sampling_batch)."""
        return bool(self.stop_token_ids) or not self.ignore_eos

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
