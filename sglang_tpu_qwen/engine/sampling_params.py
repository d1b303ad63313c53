"""SamplingParams: SGLang's `sampling_params` request field, validated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from sglang_tpu_qwen.engine.errors import InvalidRequestError
from sglang_tpu_qwen.engine.sampler import BAN_WIDTH, LOGIT_BIAS_MAX
from sglang_tpu_qwen.grammar.spec import CONSTRAINT_KEYS, GrammarSpec, spec_from_fields

DEFAULT_MAX_NEW_TOKENS = 128
# With the EOS ids (a few), stop_token_ids must fit sampler.BAN_WIDTH: all are banned before min_new_tokens.
MAX_STOP_TOKEN_IDS = BAN_WIDTH - 16


@dataclass
class SamplingParams:
    """Per-request sampling settings, with SGLang's names and defaults.

    temperature 0 means greedy. top_k -1 (or 0) means no top-k cut. `seed` (SGLang: sampling_seed)
    makes a sampled request reproducible whatever else is in its batch.
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
    # min_new_tokens bans (engine/sampler.py); at most LOGIT_BIAS_MAX entries.
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
        """Raise InvalidRequestError naming the first bad value."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        def is_num(x: Any) -> bool:  # finite: NaN or inf would silently turn the logits into junk
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not is_num(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("min_new_tokens", "top_k", "n"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None and (
            not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
            or self.max_new_tokens < 0
        ):
            bad(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:  # SGLang's rule
            bad(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.min_new_tokens < 0:
            bad(f"min_new_tokens must be non-negative, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids must be a list of non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
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
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
