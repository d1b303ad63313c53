"""What the OpenAI completion and chat routes share: request fields to sampling_params, the reply pieces
(finish_reason, usage, logprobs) and the per-choice streaming state over server/sse.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from sglang_tpu_qwen.grammar.spec import response_format_constraint
from sglang_tpu_qwen.parsers import ChatOutputParser
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.engine_calls import ClientDisconnected
from sglang_tpu_qwen.server.errors import OpenAIError
from sglang_tpu_qwen.server.protocol import (
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    LogProbs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from sglang_tpu_qwen.server.sse import sse, stream_response

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine

Triple = list  # [logprob | None, token_id, text | None], as the engine returns it
TopList = list[Triple] | None  # a token's top alternatives (None when not asked for)


# ---------------------------------------------------------------- request side


def reject_unsupported(names: list[str]) -> None:
    """Raise OpenAIError (400) naming the first of `names`, when there are any."""
    if names:
        raise OpenAIError(f"Unsupported parameter(s) for this server: {', '.join(names)}", param=names[0])


def first_rid(rids: str | list[str]) -> str:
    """The request id of a single call, or the first of a batch's."""
    return rids if isinstance(rids, str) else rids[0]


def sampling_params(req: Any, max_new_tokens: int | None) -> dict[str, Any]:
    """SGLang sampling_params from an OpenAI request (None values are left to the engine's defaults)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "n": req.n,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
    }
    return {k: v for k, v in params.items() if v is not None}


def constraint_fields(req: Any) -> dict[str, str]:
    """The request's output constraint as sampling_params keys: SGLang's extra `regex` / `ebnf` fields and
    OpenAI `response_format`. More than one is refused by SamplingParams (a 400)."""
    try:
        fields = response_format_constraint(req.response_format)
    except ValueError as e:
        raise OpenAIError(str(e), param="response_format") from None
    for name in ("regex", "ebnf"):
        if getattr(req, name, None) is not None:
            fields = {**fields, name: getattr(req, name)}
    return fields


async def generate(engine: Engine, raw: Request, rids: str | list[str], kwargs: dict[str, Any]) -> Any:
    """A non-streamed engine call; a client gone before the reply is an OpenAIError 499."""
    try:
        return await engine_calls.generate_once(engine, raw, rids, **kwargs)
    except ClientDisconnected:
        raise OpenAIError("client disconnected", status=499) from None


# ---------------------------------------------------------------- reply side


def finish_reason(meta: dict) -> str | None:
    """The OpenAI finish_reason of an engine reply ("stop", "length", "abort") or None while running."""
    fr = meta.get("finish_reason")
    return None if fr is None else fr.get("type")


def matched_stop(meta: dict) -> int | str | None:
    """SGLang's `matched_stop`: the stop token id or string that ended the reply, else None."""
    fr = meta.get("finish_reason")
    return None if fr is None else fr.get("matched")


def usage_info(outs: list[dict], n: int) -> UsageInfo:
    """Usage of a whole request: prompt tokens counted once per prompt, completion tokens per sample."""
    firsts = outs[:: max(n, 1)]
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in firsts)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def logprob_lists(meta: dict, prefix: str) -> tuple[list[Triple], list[TopList]]:
    """A reply's `{prefix}_token_logprobs` and `{prefix}_top_logprobs` (None per token when absent);
    prefix "input" or "output"."""
    toks = list(meta.get(f"{prefix}_token_logprobs") or [])
    return toks, list(meta.get(f"{prefix}_top_logprobs") or [None] * len(toks))


def _text(triple: Triple) -> str:
    return triple[2] if triple[2] is not None else ""


def completion_logprobs(toks: list[Triple], tops: list[TopList], offset: int) -> LogProbs:
    """Completion-style logprobs of these tokens; `text_offset` counts characters from `offset`."""
    out = LogProbs()
    for tok, top in zip(toks, tops, strict=False):
        out.tokens.append(_text(tok))
        out.token_logprobs.append(tok[0])
        out.text_offset.append(offset)
        offset += len(_text(tok))
        out.top_logprobs.append(None if top is None else {_text(t): t[0] for t in top})
    return out


def chat_logprobs(toks: list[Triple], tops: list[TopList]) -> ChoiceLogprobs:
    """Chat-style logprobs of these tokens."""
    content = []
    for tok, top in zip(toks, tops, strict=False):
        text = _text(tok)
        alts = [TopLogprob(token=_text(t), bytes=list(_text(t).encode()), logprob=t[0]) for t in top or []]
        content.append(
            ChatCompletionTokenLogprob(token=text, bytes=list(text.encode()), logprob=tok[0], top_logprobs=alts)
        )
    return ChoiceLogprobs(content=content)


# ---------------------------------------------------------------- streaming


@dataclass
class ChoiceStream:
    """Per-choice progress of a stream over the engine's increments."""

    started: bool = False  # the route emitted this choice's first chunk
    last: dict | None = None  # latest engine increment (its meta_info counts are totals)
    parser: ChatOutputParser | None = None
    call_ids: dict[int, str] = field(default_factory=dict)
    held_reasoning: str = ""  # stream_reasoning false: reasoning waits for the end of the block
    # Logprobs of tokens received but not sent: text held back (a stop string, a parser) delays them.
    token_lps: list[Triple] = field(default_factory=list)
    top_lps: list[TopList] = field(default_factory=list)

    def hold_logprobs(self, meta: dict) -> None:
        """Keep an increment's output logprobs until the next emitted chunk."""
        toks, tops = logprob_lists(meta, "output")
        self.token_lps += toks
        self.top_lps += tops

    def take_logprobs(self) -> tuple[list[Triple], list[TopList]]:
        """The logprobs held so far (token triples, top lists); clears them."""
        held = self.token_lps, self.top_lps
        self.token_lps, self.top_lps = [], []
        return held


# render(index, state, engine increment) -> payloads to send for it
ChoiceRender = Callable[[int, ChoiceStream, dict], list[dict]]


def continuous_usage(req: Any) -> bool:
    """Whether a streamed request asked for usage on every chunk (stream_options.continuous_usage_stats)."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def openai_stream(engine: Engine, rids: str | list[str], first: dict | None, rest: AsyncIterator[dict],
                  render: ChoiceRender, usage_payload: Callable[[list[dict]], dict | None],
                  continuous_usage: bool = False) -> StreamingResponse:
    """SSE reply shared by streamed completions and chat completions (server/sse.stream_response).

    `render` gets each engine increment with its choice's state (output logprobs already held there) and
    returns the route's payloads. After the last chunk `usage_payload(final increments by index)` may add a
    usage chunk. `continuous_usage` (stream_options.continuous_usage_stats) gives every chunk the usage of its
    choice so far, as SGLang does: that choice's prompt tokens and the completion tokens generated up to it.
    """
    states: dict[int, ChoiceStream] = {}

    def on_chunk(chunk: dict) -> list[bytes]:
        i = chunk.get("index", 0)
        state = states.setdefault(i, ChoiceStream())
        state.last = chunk
        state.hold_logprobs(chunk["meta_info"])
        payloads = render(i, state, chunk)
        if continuous_usage:
            meta = chunk["meta_info"]
            usage = UsageInfo(prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
                              total_tokens=meta["prompt_tokens"] + meta["completion_tokens"]).model_dump()
            payloads = [{**p, "usage": usage} for p in payloads]
        return [sse(payload) for payload in payloads]

    def closing() -> list[bytes]:
        payload = usage_payload([states[k].last for k in sorted(states)])  # type: ignore[misc]
        return [] if payload is None else [sse(payload)]

    return stream_response(engine, rids, first, rest, on_chunk, openai=True, closing=closing)
