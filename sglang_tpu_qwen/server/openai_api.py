"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Replies follow SGLang's OpenAI layer (`python/sglang/srt/entrypoints/openai/serving_chat.py`,
`serving_completions.py`): finish_reason "stop" / "length" / "abort" / "tool_calls", `matched_stop`, usage
with `prompt_tokens_details.cached_tokens`, SSE chunks ending in `data: [DONE]`, the first chat chunk of a
choice carrying the role.

Chat output goes through the parsers the server was started with (`--reasoning-parser`,
`--tool-call-parser`; sglang_tpu_qwen/parsers): reasoning into `reasoning_content`, tool calls into
`tool_calls` (parsed only when the request offers tools and tool_choice is not "none"). Without parsers
the raw model text is the `content`, as in SGLang. `tool_choice: "required"` or a named function
constrains decoding with an EBNF over the qwen3_coder call format (parsers/tool_grammar.py).
Constraints: SGLang's extra `regex` / `ebnf` fields and `response_format` become sampling_params.

Streaming: every generated token's logprob is sent exactly once, with the first chunk emitted after the
token arrived (text held back by a stop string or a parser delays its logprobs, never drops them).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from sglang_tpu_qwen.engine.io.errors import failed_status
from sglang_tpu_qwen.grammar.spec import response_format_constraint
from sglang_tpu_qwen.parsers import ChatOutputParser
from sglang_tpu_qwen.parsers.chat_output import ChatDelta
from sglang_tpu_qwen.parsers.markers import THINK_START
from sglang_tpu_qwen.parsers.tool_calls import merge_call_deltas
from sglang_tpu_qwen.parsers.tool_grammar import tool_call_ebnf
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.engine_calls import SSE_DONE, ClientDisconnected, sse
from sglang_tpu_qwen.server.errors import OpenAIError, model_not_found, stream_error_event
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
    FunctionCall,
    LogProbs,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from sglang_tpu_qwen.server.request_fields import bootstrap_kwargs

logger = logging.getLogger(__name__)

Triple = list  # [logprob | None, token_id, text | None], as the engine returns it


def create_openai_router(
    engine: Any, *, reasoning_parser: str | None = None, tool_call_parser: str | None = None
) -> APIRouter:
    """The OpenAI routes over one Engine (see module docstring).

    Args:
        engine: the in-process Engine.
        reasoning_parser / tool_call_parser: parser names (parsers.REASONING_PARSERS / TOOL_CALL_PARSERS);
            None takes `engine.server_args.reasoning_parser` / `.tool_call_parser`.
    """
    router = APIRouter()
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
        _reject_unsupported(req.unsupported_fields())
        inputs, batch_size, prompts_text = _completion_inputs(engine, req.prompt)
        sampling = {**_sampling_params(req, req.max_tokens), **_constraint_fields(req)}
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
        plan = _plan_chat(engine, req, reasoning, tool_parser)
        kwargs = dict(
            text=plan.prompt,
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
            return await _stream_chat(engine, req, rids, kwargs, plan)
        out = await _generate(engine, raw, rids, kwargs)
        outs = out if isinstance(out, list) else [out]
        choices = [_chat_choice(i, o, req, plan) for i, o in enumerate(outs)]
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
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "n": req.n,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
    }
    return {k: v for k, v in params.items() if v is not None}


def _constraint_fields(req: Any) -> dict[str, str]:
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


def _template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them.

    Content parts are joined; `developer` (OpenAI's newer name for it) is `system`; assistant tool-call
    arguments given as a JSON string (OpenAI's form) are parsed into the object the template renders, as
    SGLang does. Raises OpenAIError (400) for arguments that are not a JSON object.
    """
    messages = []
    for i, msg in enumerate(req.messages):
        d = msg.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        d["content"] = _message_content(msg) or ""
        for call in d.get("tool_calls") or []:
            fn = call["function"]
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise OpenAIError(
                        f"messages[{i}].tool_calls: function.arguments must be a JSON object "
                        "(or a string holding one)", param="messages")
                fn["arguments"] = args
        messages.append(d)
    return messages


@dataclass
class ChatPlan:
    """What a chat request turns into: prompt text, sampling_params, and how to parse each choice."""

    prompt: str
    sampling: dict[str, Any]
    reasoning_parser: str | None
    tool_call_parser: str | None
    thinking: bool
    tools: list[Any] | None  # tools whose calls are parsed (None: tool-call parsing off)
    # The client's constraint applies after the reasoning block (SGLang's require_reasoning with a reasoning
    # parser), so its output lands in `content`; a forced tool call's grammar covers the reasoning itself.
    grammar_after_reasoning: bool = False

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one choice."""
        return ChatOutputParser(self.reasoning_parser, self.tool_call_parser, thinking=self.thinking,
                                tools=self.tools)


def _plan_chat(engine: Any, req: ChatCompletionRequest, reasoning: str | None, tool_parser: str | None) -> ChatPlan:
    """Render the prompt and build sampling_params (with the tool-call constraint) for a chat request."""
    template_kwargs = dict(req.chat_template_kwargs or {})
    choice = req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    tools = None
    if req.tools and choice != "none":
        # As SGLang: a named tool_choice shows the model only that function.
        tools = [t for t in req.tools if named is None or t.function.name == named]
        if not tools:
            raise OpenAIError(f"tool_choice names function {named!r}, which is not in tools", param="tool_choice")
    elif choice == "required" or named is not None:
        raise OpenAIError("tool_choice requires tools", param="tool_choice")
    # The tools as the client wrote them (no defaults added, e.g. `strict`), like the messages.
    tool_dicts = [t.model_dump(exclude_none=True, exclude_unset=True) for t in tools] if tools else None
    try:
        prompt = engine.tokenizer.apply_chat_template(
            _template_messages(req), tools=tool_dicts, add_generation_prompt=True, **template_kwargs
        )
    except OpenAIError:
        raise
    except Exception as e:  # the template rejecting its input (raise_exception, a filter on a bad type)
        raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from None

    # The output starts inside the reasoning when the generation prompt left a <think> block open (Qwen3.5
    # with thinking on); enable_thinking false closes it, and a template without thinking never opens one.
    thinking = prompt.rstrip().endswith(THINK_START)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:  # SGLang: a chat without a limit may run to the end of the context
        max_new = max(0, engine.room_for(len(engine.tokenizer.encode(prompt))))
    sampling = {**_sampling_params(req, max_new), **_constraint_fields(req)}
    forced = bool(tool_dicts) and (choice == "required" or named is not None)
    user_constrained = any(k in sampling for k in ("regex", "ebnf", "json_schema", "structural_tag"))
    if forced:
        if any(k in sampling for k in ("regex", "ebnf", "json_schema", "structural_tag")):
            raise OpenAIError("tool_choice 'required' or a named function cannot be combined with regex, ebnf "
                              "or response_format", param="tool_choice")
        sampling["ebnf"] = tool_call_ebnf(tool_dicts, named, thinking=thinking, parallel=req.parallel_tool_calls)
    return ChatPlan(
        prompt=prompt,
        sampling=sampling,
        reasoning_parser=reasoning if req.separate_reasoning else None,
        # A forced call is in the qwen3_coder format (the grammar's), so it is parsed even without the flag.
        tool_call_parser=tool_parser or ("qwen3_coder" if forced else None),
        thinking=thinking,
        tools=tools,
        grammar_after_reasoning=bool(reasoning) and thinking and user_constrained and not forced,
    )


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
    tops: list = list(meta.get("output_top_logprobs") or [None] * (start + len(toks)))[start:]
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


def _new_call_id() -> str:
    """A tool call id in SGLang's form (`call_` + 24 hex chars)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _chat_finish(meta: dict, has_tool_calls: bool) -> tuple[str | None, int | str | None]:
    """finish_reason and matched_stop of a chat choice: a natural stop after tool calls is "tool_calls"."""
    reason = _finish_reason(meta)
    if reason == "stop" and has_tool_calls:
        return "tool_calls", None
    return reason, _matched_stop(meta)


def _chat_choice(index: int, out: dict, req: ChatCompletionRequest, plan: ChatPlan) -> ChatCompletionResponseChoice:
    """One non-streamed chat choice: the output parsed into content / reasoning_content / tool_calls."""
    meta = out["meta_info"]
    parser = plan.parser()
    if parser.active:
        msg = parser.parse(out["text"])
        calls = [
            ToolCall(id=_new_call_id(), index=c.index, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in msg.tool_calls
        ]
        message = ChatCompletionMessage(content=msg.content, reasoning_content=msg.reasoning,
                                        tool_calls=calls or None)
    else:
        calls = []
        message = ChatCompletionMessage(content=out["text"])
    reason, matched = _chat_finish(meta, bool(calls))
    return ChatCompletionResponseChoice(
        index=index,
        message=message,
        logprobs=_chat_logprobs(meta, 0) if req.logprobs else None,
        finish_reason=reason,
        matched_stop=matched,
    )


# ---------------------------------------------------------------- streaming


@dataclass
class _ChoiceStream:
    """Per-choice progress of a stream: what of the engine's cumulative reply was already handled."""

    text_sent: int = 0  # chars of the cumulative text handed to the route
    tokens_sent: int = 0  # output tokens whose logprobs went out
    started: bool = False  # the route emitted this choice's first chunk
    last: dict | None = None  # latest engine chunk
    parser: ChatOutputParser | None = None
    call_ids: dict[int, str] = field(default_factory=dict)
    held_reasoning: str = ""  # stream_reasoning false: reasoning waits for the end of the block

    def take_tokens(self, meta: dict) -> int:
        """Index of the first output token whose logprob is not yet sent; marks all current ones sent."""
        start = self.tokens_sent
        self.tokens_sent = len(meta.get("output_token_logprobs") or [])
        return start


# render(index, state, engine chunk, new text) -> payloads to send for this engine chunk
Render = Callable[[int, _ChoiceStream, dict, str], list[dict]]


def _stream_response(engine: Any, rids: Any, first: dict | None, rest: AsyncIterator, render: Render,
                     usage_payload: Callable[[list[dict]], dict | None]) -> StreamingResponse:
    """SSE reply shared by streamed completions and chat completions.

    The engine's chunks carry cumulative text; `render` gets each chunk with the text new to its choice
    and returns the route's payloads. After the last chunk `usage_payload(final chunks by index)` may add
    a usage chunk. An engine failure is reported inside the stream; a client that goes away (the body
    generator is closed) aborts the requests.
    """

    async def body() -> AsyncIterator[bytes]:
        states: dict[int, _ChoiceStream] = {}
        finished = False
        try:
            chunk = first
            while chunk is not None:
                reason = chunk["meta_info"]["finish_reason"]
                if failed_status(reason) is not None:  # the server failed it: an error event, no usage
                    yield sse(stream_error_event(reason, openai=True))
                    break
                i = chunk.get("index", 0)
                state = states.setdefault(i, _ChoiceStream())
                new_text = chunk["text"][state.text_sent :]
                state.text_sent, state.last = len(chunk["text"]), chunk
                for payload in render(i, state, chunk, new_text):
                    yield sse(payload)
                chunk = await anext(rest, None)
            else:
                usage = usage_payload([states[k].last for k in sorted(states)])
                if usage is not None:
                    yield sse(usage)
                finished = True
        except Exception as e:  # an engine failure mid-stream: tell the client inside the stream
            logger.exception("stream failed")
            yield sse(stream_error_event({"message": str(e), "status_code": 500}, openai=True))
        finally:
            if not finished:
                engine_calls.abort_all(engine, rids)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completion(engine: Any, req: CompletionRequest, rids: Any, kwargs: dict, echo_of) -> Any:
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"cmpl-{_first(rids)}"
    want_logprobs = req.logprobs is not None

    def render(i: int, state: _ChoiceStream, chunk: dict, new_text: str) -> list[dict]:
        meta = chunk["meta_info"]
        fr = _finish_reason(meta)
        echo = req.echo and not state.started
        if echo:
            new_text = echo_of(i) + new_text
        if not new_text and fr is None:
            return []  # nothing to show yet (held back): the tokens' logprobs go with the next chunk
        state.started = True
        start = state.take_tokens(meta)
        choice = CompletionResponseChoice(
            index=i,
            text=new_text,
            logprobs=_completion_logprobs(meta, echo, 0, start) if want_logprobs else None,
            finish_reason=fr,
            matched_stop=_matched_stop(meta),
        )
        return [CompletionResponse(id=cid, model=req.model, choices=[choice]).model_dump(exclude={"usage"})]

    def usage(finals: list[dict]) -> dict | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return CompletionResponse(id=cid, model=req.model, choices=[], usage=_usage(finals, req.n)).model_dump()

    return _stream_response(engine, rids, first, rest, render, usage)


async def _stream_chat(engine: Any, req: ChatCompletionRequest, rids: Any, kwargs: dict, plan: ChatPlan) -> Any:
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"chatcmpl-{rids}"

    def payload(choice: ChatCompletionStreamChoice) -> dict:
        return ChatCompletionStreamResponse(id=cid, model=req.model, choices=[choice]).model_dump(exclude={"usage"})

    def render(i: int, state: _ChoiceStream, chunk: dict, new_text: str) -> list[dict]:
        out = []
        if not state.started:
            state.started, state.parser = True, plan.parser()
            out.append(payload(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))))
        meta = chunk["meta_info"]
        fr = _finish_reason(meta)
        delta = state.parser.feed(new_text)
        if fr is not None:
            last = state.parser.finish()
            delta = ChatDelta(delta.reasoning + last.reasoning, delta.content + last.content,
                              delta.tool_calls + last.tool_calls)
        reasoning = delta.reasoning
        if not req.stream_reasoning:  # SGLang: the reasoning comes in one piece once the block ends
            state.held_reasoning += reasoning
            reasoning = ""
            if state.held_reasoning and (fr is not None or delta.content or delta.tool_calls):
                reasoning, state.held_reasoning = state.held_reasoning, ""
        calls = []
        for c in merge_call_deltas(delta.tool_calls):
            new = c.index not in state.call_ids
            call_id = state.call_ids.setdefault(c.index, _new_call_id())
            calls.append(ToolCall(id=call_id if new else None, index=c.index,
                                  function=FunctionCall(name=c.name, arguments=c.arguments)))
        if not (reasoning or delta.content or calls) and fr is None:
            return out  # held back by a parser or a stop string: the logprobs go with the next chunk
        lp = _chat_logprobs(meta, state.take_tokens(meta)) if req.logprobs else None
        reason, matched = _chat_finish(meta, bool(state.call_ids)) if fr is not None else (None, None)
        out.append(payload(ChatCompletionStreamChoice(
            index=i,
            delta=DeltaMessage(content=delta.content or None, reasoning_content=reasoning or None,
                               tool_calls=calls or None),
            logprobs=lp,
            finish_reason=reason,
            matched_stop=matched,
        )))
        return out

    def usage(finals: list[dict]) -> dict | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return ChatCompletionStreamResponse(
            id=cid, model=req.model, choices=[], usage=_usage(finals, req.n)
        ).model_dump()

    return _stream_response(engine, rids, first, rest, render, usage)


__all__ = ["ChatPlan", "create_openai_router"]
