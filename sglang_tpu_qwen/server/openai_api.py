"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Replies follow SGLang's OpenAI layer (`python/sglang/srt/entrypoints/openai/serving_chat.py`,
`serving_completions.py`): finish_reason "stop" / "length" / "abort" / "tool_calls", `matched_stop`, usage
with `prompt_tokens_details.cached_tokens`, SSE chunks ending in `data: [DONE]`, the first chat chunk of a
choice carrying the role. Constraints: SGLang's extra `regex` / `ebnf` fields and `response_format` become
sampling_params.

This module holds the routes and the completion route's work; the chat route's is in openai_chat.py, what
both share (sampling_params, usage, logprobs, the per-choice stream state) in openai_common.py, the SSE
streamer in sse.py.

Streaming: every generated token's logprob is sent exactly once, with the first chunk emitted after the
token arrived (text held back by a stop string or a parser delays its logprobs, never drops them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from sglang_tpu_qwen.multimodal.image_inputs import ImageInputs
from sglang_tpu_qwen.parsers import ChatOutputParser
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.errors import OpenAIError, model_not_found
from sglang_tpu_qwen.server.openai_chat import ChatPlan, chat_choice, chat_image_refs, plan_chat, stream_chat
from sglang_tpu_qwen.server.openai_common import (
    ChoiceStream,
    completion_logprobs,
    constraint_fields,
    continuous_usage,
    finish_reason,
    first_rid,
    generate,
    logprob_lists,
    matched_stop,
    openai_stream,
    reject_unsupported,
    sampling_params,
    usage_info,
)
from sglang_tpu_qwen.server.protocol import (
    DEFAULT_MODEL_NAME,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    LogProbs,
    ModelCard,
    ModelList,
)
from sglang_tpu_qwen.server.request_fields import bootstrap_kwargs

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine


def create_openai_router(
    engine: Engine, *, reasoning_parser: str | None = None, tool_call_parser: str | None = None,
    images: ImageInputs | None = None,
) -> APIRouter:
    """The OpenAI routes over one Engine (see module docstring).

    Args:
        engine: the in-process Engine.
        reasoning_parser / tool_call_parser: parser names (parsers.REASONING_PARSERS / TOOL_CALL_PARSERS);
            None takes `engine.server_args.reasoning_parser` / `.tool_call_parser`.
        images: the chat route's image loader (default: `ImageInputs.for_engine(engine)`).
    """
    router = APIRouter()
    images = images if images is not None else ImageInputs.for_engine(engine)
    args = getattr(engine, "server_args", None)
    reasoning = reasoning_parser if reasoning_parser is not None else getattr(args, "reasoning_parser", None)
    tool_parser = tool_call_parser if tool_call_parser is not None else getattr(args, "tool_call_parser", None)
    ChatOutputParser(reasoning, tool_parser)  # fail at startup on an unknown parser name

    def card() -> ModelCard:
        name = engine.served_model_name
        return ModelCard(id=name, root=name, max_model_len=engine.context_length)

    def check_model(model: str) -> None:
        if model not in (engine.served_model_name, engine.model_path, DEFAULT_MODEL_NAME):
            raise model_not_found(model)

    @router.get("/v1/models")
    async def list_models() -> dict:
        return ModelList(data=[card()]).model_dump()

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        check_model(model)
        return card().model_copy(update={"id": model, "root": model}).model_dump()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        check_model(req.model)
        reject_unsupported(req.unsupported_fields())
        inputs, batch_size, prompts_text = _completion_inputs(engine, req.prompt)
        sampling = {**sampling_params(req, req.max_tokens), **constraint_fields(req)}
        want_logprobs = req.logprobs is not None
        kwargs = dict(
            sampling_params=sampling,
            return_logprob=want_logprobs,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_logprobs and req.echo) else None,
            return_text_in_logprobs=True,
            **inputs,
            **bootstrap_kwargs(req),  # PD disaggregation: injected by the router into both legs
        )
        rids = engine_calls.make_rids(req.rid, batch_size)
        prompt_of = _prompt_index(req.n)
        echo_of = (lambda i: prompts_text[prompt_of(i)]) if req.echo else (lambda i: "")
        if req.stream:
            return await _stream_completion(engine, req, rids, kwargs, echo_of)
        out = await generate(engine, raw, rids, kwargs)
        outs = out if isinstance(out, list) else [out]
        choices = [
            CompletionResponseChoice(
                index=i,
                text=echo_of(i) + o["text"],
                logprobs=_completion_choice_logprobs(o["meta_info"], req.echo, len(echo_of(i)))
                if want_logprobs
                else None,
                finish_reason=finish_reason(o["meta_info"]),
                matched_stop=matched_stop(o["meta_info"]),
            )
            for i, o in enumerate(outs)
        ]
        return CompletionResponse(
            id=f"cmpl-{first_rid(rids)}", model=req.model, choices=choices, usage=usage_info(outs, req.n)
        ).model_dump()

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        check_model(req.model)
        reject_unsupported(req.unsupported_fields())
        refs = chat_image_refs(req)
        items = await images.aload(refs) if refs else None
        plan = plan_chat(engine, req, reasoning, tool_parser, items, images.pad_id)
        kwargs = dict(
            **plan.engine_inputs(),
            sampling_params=plan.sampling,
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            return_text_in_logprobs=True,
            # As SGLang with a reasoning parser: a constraint applies once the reasoning block ends.
            **({"require_reasoning": True} if plan.grammar_after_reasoning else {}),
            **bootstrap_kwargs(req),  # PD disaggregation: injected by the router into both legs
        )
        rids = engine_calls.make_rids(req.rid, None)
        if req.stream:
            return await stream_chat(engine, req, rids, kwargs, plan)
        out = await generate(engine, raw, rids, kwargs)
        outs = out if isinstance(out, list) else [out]
        choices = [chat_choice(i, o, req, plan) for i, o in enumerate(outs)]
        return ChatCompletionResponse(
            id=f"chatcmpl-{rids}", model=req.model, choices=choices, usage=usage_info(outs, req.n)
        ).model_dump(exclude_none=False)

    return router


# ---------------------------------------------------------------- completions


def _prompt_index(n: int):
    """Replies are prompt-major with n samples per prompt: reply i belongs to prompt i // n."""
    return lambda i: i // max(n, 1)


def _completion_inputs(engine: Engine, prompt: Any) -> tuple[dict[str, Any], int | None, list[str]]:
    """Engine inputs for a completion prompt, the batch size (None for one prompt) and prompt texts."""
    if isinstance(prompt, str):
        return {"text": prompt}, None, [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return {"text": list(prompt)}, len(prompt), list(prompt)
    # Token ids are checked before they are decoded for `echo` (the tokenizer raises on a negative id).
    if all(isinstance(p, int) for p in prompt):
        engine.check_input_ids(prompt)
        return {"input_ids": list(prompt)}, None, [engine.tokenizer.decode(prompt, skip_special_tokens=False)]
    if all(isinstance(p, list) for p in prompt):
        for p in prompt:
            engine.check_input_ids(p)
        texts = [engine.tokenizer.decode(p, skip_special_tokens=False) for p in prompt]
        return {"input_ids": [list(p) for p in prompt]}, len(prompt), texts
    raise OpenAIError("prompt must be a string, a list of strings, or token ids", param="prompt")


def _completion_choice_logprobs(meta: dict, echo: bool, offset: int) -> LogProbs:
    """A non-streamed completion choice's logprobs: the prompt's first when echo (offsets from 0)."""
    toks, tops = logprob_lists(meta, "output")
    if echo:
        in_toks, in_tops = logprob_lists(meta, "input")
        return completion_logprobs(in_toks + toks, in_tops + tops, 0)
    return completion_logprobs(toks, tops, offset)


async def _stream_completion(engine: Engine, req: CompletionRequest, rids: str | list[str], kwargs: dict[str, Any],
                             echo_of: Callable[[int], str]) -> StreamingResponse:
    """The SSE reply of a streamed completion: one chunk per engine increment that shows text."""
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"cmpl-{first_rid(rids)}"
    want_logprobs = req.logprobs is not None

    def render(i: int, state: ChoiceStream, chunk: dict) -> list[dict]:
        new_text = chunk["text"]
        meta = chunk["meta_info"]
        fr = finish_reason(meta)
        echo = req.echo and not state.started
        if echo:
            new_text = echo_of(i) + new_text
        if not new_text and fr is None:
            return []  # nothing to show yet (held back): the tokens' logprobs go with the next chunk
        state.started = True
        choice = CompletionResponseChoice(
            index=i,
            text=new_text,
            logprobs=_stream_logprobs(meta, state, echo) if want_logprobs else None,
            finish_reason=fr,
            matched_stop=matched_stop(meta),
        )
        return [CompletionResponse(id=cid, model=req.model, choices=[choice]).model_dump(exclude={"usage"})]

    def usage(finals: list[dict]) -> dict | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return CompletionResponse(id=cid, model=req.model, choices=[], usage=usage_info(finals, req.n)).model_dump()

    return openai_stream(engine, rids, first, rest, render, usage, continuous_usage(req))


def _stream_logprobs(meta: dict, state: ChoiceStream, echo: bool) -> LogProbs:
    """A streamed completion chunk's logprobs: the held output tokens', the prompt's first when echo (the
    choice's first chunk); offsets count from 0 in each chunk."""
    toks, tops = state.take_logprobs()
    if echo:
        in_toks, in_tops = logprob_lists(meta, "input")
        toks, tops = in_toks + toks, in_tops + tops
    return completion_logprobs(toks, tops, 0)


__all__ = ["ChatPlan", "create_openai_router"]
