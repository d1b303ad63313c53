"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Replies follow SGLang's OpenAI layer (`python/sglang/srt/entrypoints/openai/serving_chat.py`,
`serving_completions.py`): finish_reason "stop" / "length" / "abort", `matched_stop`, usage with
`prompt_tokens_details.cached_tokens`, SSE chunks ending in `data: [DONE]`, the first chat chunk of a
choice carrying the role. Without a reasoning or tool-call parser configured, SGLang returns the raw
model text as `content`; so does this server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.engine_calls import SSE_DONE, ClientDisconnected, sse
from sglang_tpu_qwen.server.errors import OpenAIError, model_not_found
from sglang_tpu_qwen.server.protocol import (
    DEFAULT_MODEL_NAME,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    LogProbs,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

Triple = list  # [logprob | None, token_id, text | None], as the engine returns it


def create_openai_router(engine: Any) -> APIRouter:
    """The OpenAI routes over one Engine (see module docstring)."""
    router = APIRouter()

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
        _reject_unsupported(req.unsupported_fields())
        inputs, batch_size, prompts_text = _completion_inputs(engine, req.prompt)
        sampling = _sampling_params(req, req.max_tokens)
        want_logprobs = req.logprobs is not None
        kwargs = dict(
            sampling_params=sampling,
            return_logprob=want_logprobs,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_logprobs and req.echo) else None,
            return_text_in_logprobs=True,
            **inputs,
        )
        rids = engine_calls.make_rids(req.rid, batch_size)
        prompt_of = _prompt_index(req.n)
        echo_of = (lambda i: prompts_text[prompt_of(i)]) if req.echo else (lambda i: "")
        if req.stream:
            return await _stream_completion(engine, req, rids, kwargs, echo_of)
        out = await _generate(engine, raw, rids, kwargs)
        outs = out if isinstance(out, list) else [out]
        choices = [
            CompletionResponseChoice(
                index=i,
                text=echo_of(i) + o["text"],
                logprobs=_completion_logprobs(o["meta_info"], req.echo, len(echo_of(i)))
                if want_logprobs
                else None,
                finish_reason=_finish_reason(o["meta_info"]),
                matched_stop=_matched_stop(o["meta_info"]),
            )
            for i, o in enumerate(outs)
        ]
        return CompletionResponse(
            id=f"cmpl-{_first(rids)}", model=req.model, choices=choices, usage=_usage(outs, req.n)
        ).model_dump()

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        check_model(req.model)
        _reject_unsupported(req.unsupported_fields())
        prompt = _render_chat(engine, req)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:  # SGLang: a chat without a limit may run to the end of the context
            max_new = max(0, engine.room_for(len(engine.tokenizer.encode(prompt))))
        kwargs = dict(
            text=prompt,
            sampling_params=_sampling_params(req, max_new),
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            return_text_in_logprobs=True,
        )
        rids = engine_calls.make_rids(req.rid, None)
        if req.stream:
            return await _stream_chat(engine, req, rids, kwargs)
        out = await _generate(engine, raw, rids, kwargs)
        outs = out if isinstance(out, list) else [out]
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatCompletionMessage(role="assistant", content=o["text"]),
                logprobs=_chat_logprobs(o["meta_info"], 0) if req.logprobs else None,
                finish_reason=_finish_reason(o["meta_info"]),
                matched_stop=_matched_stop(o["meta_info"]),
            )
            for i, o in enumerate(outs)
        ]
        return ChatCompletionResponse(
            id=f"chatcmpl-{rids}", model=req.model, choices=choices, usage=_usage(outs, req.n)
        ).model_dump(exclude_none=False)

    return router


# ---------------------------------------------------------------- request side


def _reject_unsupported(names: list[str]) -> None:
    if names:
        raise OpenAIError(f"Unsupported parameter(s) for this server: {', '.join(names)}", param=names[0])


def _first(rids: str | list[str]) -> str:
    return rids if isinstance(rids, str) else rids[0]


def _prompt_index(n: int):
    """Replies are prompt-major with n samples per prompt: reply i belongs to prompt i // n."""
    return lambda i: i // max(n, 1)


def _completion_inputs(engine: Any, prompt: Any) -> tuple[dict[str, Any], int | None, list[str]]:
    """Engine inputs for a completion prompt, the batch size (None for one prompt) and prompt texts."""
    if isinstance(prompt, str):
        return {"text": prompt}, None, [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return {"text": list(prompt)}, len(prompt), list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return {"input_ids": list(prompt)}, None, [engine.tokenizer.decode(prompt, skip_special_tokens=False)]
    if all(isinstance(p, list) for p in prompt):
        texts = [engine.tokenizer.decode(p, skip_special_tokens=False) for p in prompt]
        return {"input_ids": [list(p) for p in prompt]}, len(prompt), texts
    raise OpenAIError("prompt must be a string, a list of strings, or token ids", param="prompt")


def _sampling_params(req: Any, max_new_tokens: int | None) -> dict[str, Any]:
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
        "no_stop_trim": req.no_stop_trim,
        "n": req.n,
        "seed": req.seed,
    }
    return {k: v for k, v in params.items() if v is not None}


def _message_content(msg: Any) -> str | None:
    """A message's content as a string; list content must hold only text parts (joined by newlines)."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    texts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(
                f"Unsupported content part type {part.type!r}: this model takes text only", param="messages"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _render_chat(engine: Any, req: ChatCompletionRequest) -> str:
    """The prompt text: the model's chat template over the messages (and tools, unless tool_choice none)."""
    messages = []
    for msg in req.messages:
        d = msg.model_dump(exclude_none=True)
        d["content"] = _message_content(msg) or ""
        messages.append(d)
    tools = None
    if req.tools and req.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        return engine.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, **(req.chat_template_kwargs or {})
        )
    except OpenAIError:
        raise
    except Exception as e:  # a template raising on its input (jinja `raise_exception`) is the client's error
        raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from None


async def _generate(engine: Any, raw: Request, rids: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return await engine_calls.generate_once(engine, raw, rids, **kwargs)
    except ClientDisconnected:
        raise OpenAIError("client disconnected", status=499) from None


# ---------------------------------------------------------------- reply side


def _finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    return None if fr is None else fr.get("type")


def _matched_stop(meta: dict) -> int | str | None:
    fr = meta.get("finish_reason")
    return None if fr is None else fr.get("matched")


def _usage(outs: list[dict], n: int) -> UsageInfo:
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


def _text(triple: Triple) -> str:
    return triple[2] if triple[2] is not None else ""


def _completion_logprobs(meta: dict, echo: bool, offset: int, start: int = 0) -> LogProbs:
    """Completion-style logprobs of output tokens [start:], prompt tokens first when echo (start == 0)."""
    toks: list[Triple] = list(meta.get("output_token_logprobs") or [])[start:]
    tops: list = list(meta.get("output_top_logprobs") or [None] * len(toks))[start:]
    if echo and start == 0:
        toks = list(meta.get("input_token_logprobs") or []) + toks
        tops = (
            list(meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs") or []))
            + tops
        )
        offset = 0
    out = LogProbs()
    for tok, top in zip(toks, tops, strict=False):
        out.tokens.append(_text(tok))
        out.token_logprobs.append(tok[0])
        out.text_offset.append(offset)
        offset += len(_text(tok))
        out.top_logprobs.append(None if top is None else {_text(t): t[0] for t in top})
    return out


def _chat_logprobs(meta: dict, start: int) -> ChoiceLogprobs:
    """Chat-style logprobs of output tokens [start:]."""
    toks = list(meta.get("output_token_logprobs") or [])[start:]
    tops = list(meta.get("output_top_logprobs") or [None] * (start + len(toks)))[start:]
    content = []
    for tok, top in zip(toks, tops, strict=False):
        text = _text(tok)
        alts = [TopLogprob(token=_text(t), bytes=list(_text(t).encode()), logprob=t[0]) for t in top or []]
        content.append(
            ChatCompletionTokenLogprob(
                token=text, bytes=list(text.encode()), logprob=tok[0], top_logprobs=alts
            )
        )
    return ChoiceLogprobs(content=content)


def _sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream")


async def _stream_completion(engine: Any, req: CompletionRequest, rids: Any, kwargs: dict, echo_of) -> Any:
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"cmpl-{_first(rids)}"
    want_logprobs = req.logprobs is not None

    async def body() -> AsyncIterator[bytes]:
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        last: dict[int, dict] = {}
        finished = False
        try:
            chunk = first
            while chunk is not None:
                i = chunk.get("index", 0)
                meta = chunk["meta_info"]
                last[i] = chunk
                new_text = chunk["text"][sent_text.get(i, 0) :]
                if i not in sent_text:
                    new_text = echo_of(i) + new_text
                fr = _finish_reason(meta)
                if new_text or fr is not None:
                    lp = None
                    if want_logprobs:
                        lp = _completion_logprobs(
                            meta, req.echo and i not in sent_text, 0, sent_toks.get(i, 0)
                        )
                    choice = CompletionResponseChoice(
                        index=i,
                        text=new_text,
                        logprobs=lp,
                        finish_reason=fr,
                        matched_stop=_matched_stop(meta),
                    )
                    yield sse(
                        CompletionResponse(id=cid, model=req.model, choices=[choice]).model_dump(
                            exclude={"usage"}
                        )
                    )
                sent_text[i] = len(chunk["text"])
                sent_toks[i] = len(meta.get("output_token_logprobs") or [])
                chunk = await anext(rest, None)
            if req.stream_options and req.stream_options.include_usage:
                outs = [last[k] for k in sorted(last)]
                yield sse(
                    CompletionResponse(
                        id=cid, model=req.model, choices=[], usage=_usage(outs, req.n)
                    ).model_dump()
                )
            finished = True
        except Exception as e:  # an engine failure mid-stream: tell the client inside the stream
            yield sse({"error": {"message": str(e)}})
            finished = True
        finally:
            if not finished:
                engine_calls.abort_all(engine, rids)
        yield SSE_DONE

    return _sse_response(body())


async def _stream_chat(engine: Any, req: ChatCompletionRequest, rids: Any, kwargs: dict) -> Any:
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"chatcmpl-{rids}"

    def chunk_of(choice: ChatCompletionStreamChoice) -> bytes:
        return sse(
            ChatCompletionStreamResponse(id=cid, model=req.model, choices=[choice]).model_dump(
                exclude={"usage"}
            )
        )

    async def body() -> AsyncIterator[bytes]:
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        last: dict[int, dict] = {}
        finished = False
        try:
            chunk = first
            while chunk is not None:
                i = chunk.get("index", 0)
                meta = chunk["meta_info"]
                last[i] = chunk
                if i not in sent_text:
                    sent_text[i] = 0
                    yield chunk_of(
                        ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    )
                new_text = chunk["text"][sent_text[i] :]
                fr = _finish_reason(meta)
                if new_text or fr is not None:
                    lp = _chat_logprobs(meta, sent_toks.get(i, 0)) if req.logprobs else None
                    yield chunk_of(
                        ChatCompletionStreamChoice(
                            index=i,
                            delta=DeltaMessage(content=new_text or None),
                            logprobs=lp,
                            finish_reason=fr,
                            matched_stop=_matched_stop(meta),
                        )
                    )
                sent_text[i] = len(chunk["text"])
                sent_toks[i] = len(meta.get("output_token_logprobs") or [])
                chunk = await anext(rest, None)
            if req.stream_options and req.stream_options.include_usage:
                outs = [last[k] for k in sorted(last)]
                yield sse(
                    ChatCompletionStreamResponse(
                        id=cid, model=req.model, choices=[], usage=_usage(outs, req.n)
                    ).model_dump()
                )
            finished = True
        except Exception as e:  # an engine failure mid-stream: tell the client inside the stream
            yield sse({"error": {"message": str(e)}})
            finished = True
        finally:
            if not finished:
                engine_calls.abort_all(engine, rids)
        yield SSE_DONE

    return _sse_response(body())


__all__ = ["create_openai_router"]
