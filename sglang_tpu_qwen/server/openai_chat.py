"""The OpenAI chat route's work: the prompt and sampling_params of a request (`plan_chat`), its choices
parsed into content / reasoning_content / tool_calls (`chat_choice`), and its stream (`stream_chat`).

Chat output goes through the parsers the server was started with (`--reasoning-parser`,
`--tool-call-parser`; sglang_tpu_qwen/parsers): reasoning into `reasoning_content`, tool calls into
`tool_calls` (parsed only when the request offers tools and tool_choice is not "none"). Without parsers
the raw model text is the `content`, as in SGLang. `tool_choice: "required"` or a named function
constrains decoding with an EBNF over the qwen3_coder call format (parsers/tool_grammar.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_tpu_qwen.engine.io.multimodal import ImageItem
from sglang_tpu_qwen.multimodal.prompt_tokens import expand_image_pads
from sglang_tpu_qwen.parsers import ChatOutputParser
from sglang_tpu_qwen.parsers.chat_output import ChatDelta
from sglang_tpu_qwen.parsers.markers import THINK_START
from sglang_tpu_qwen.parsers.tool_calls import merge_call_deltas
from sglang_tpu_qwen.parsers.tool_grammar import tool_call_ebnf
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.errors import OpenAIError
from sglang_tpu_qwen.server.openai_common import (
    ChoiceStream,
    chat_logprobs,
    constraint_fields,
    continuous_usage,
    finish_reason,
    logprob_lists,
    matched_stop,
    openai_stream,
    sampling_params,
    usage_info,
)
from sglang_tpu_qwen.server.protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    FunctionCall,
    ToolCall,
)

if TYPE_CHECKING:
    from fastapi.responses import StreamingResponse

    from sglang_tpu_qwen.engine.engine import Engine


def _message_content(msg: Any) -> str | list[dict[str, str]] | None:
    """A message's content as the template takes it.

    A string stays a string; a list of text parts is joined by newlines. A list with `image_url` parts stays a
    list of `{"type": "text", "text"}` and `{"type": "image"}` parts in order, which Qwen3.5's template renders
    as the text and `<|vision_start|><|image_pad|><|vision_end|>` per image, with nothing between parts.
    Raises OpenAIError (400) for another part type or a part without its field.
    """
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    parts: list[dict[str, str]] = []
    for part in msg.content:
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and part.image_url is not None:
            parts.append({"type": "image"})
        else:
            raise OpenAIError(f"Unsupported content part type {part.type!r} (or its {part.type!r} field is "
                              "missing): text and image_url parts are supported", param="messages")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def chat_image_refs(req: ChatCompletionRequest) -> list[str]:
    """The `image_url.url` of every image part of the conversation, in order (the order of their placeholders in
    the rendered prompt). Raises OpenAIError (400) for an image in a system / developer message (Qwen3.5's
    template refuses those)."""
    refs = []
    for msg in req.messages:
        if isinstance(msg.content, str) or msg.content is None:
            continue
        urls = [p.image_url.url for p in msg.content if p.type == "image_url" and p.image_url is not None]
        if urls and msg.role in ("system", "developer"):
            raise OpenAIError("System message cannot contain images.", param="messages")
        refs.extend(urls)
    return refs


def _template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them.

    Content parts are joined (kept as parts around images); `developer` (OpenAI's newer name for it) is `system`;
    assistant tool-call arguments given as a JSON string (OpenAI's form) are parsed into the object the template
    renders, as SGLang does. Raises OpenAIError (400) for arguments that are not a JSON object.
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


_OPEN_MARK = "\x00sglang-tpu-qwen:continue\x00"  # never in a message: marks where the final one ends
_ASSISTANT_OPEN = "<|im_start|>assistant\n"
_EMPTY_THINK = "<think>\n\n</think>\n\n"


def render_open_final(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None,
                      template_kwargs: dict[str, Any]) -> str:
    """The chat rendered with the final (assistant) message left open: `continue_final_message`.

    As HF's `apply_chat_template(continue_final_message=True)` (which SGLang calls): the conversation is rendered
    without a generation prompt and cut right after the final message's content, so the model continues it
    rather than answering it. The cut is found with a marker appended to that content, so leading whitespace the
    template trims and an empty content both work. Qwen3.5's released template gives the turn in progress (an
    assistant message after the last user message) a think block, an empty one when it has no reasoning; ours
    renders none for an empty reasoning, so the empty block is added, and the model continues the answer after
    it whether thinking is on or off.

    Raises:
        OpenAIError (400): the last message is not an assistant message, or the template drops its content.
    """
    if messages[-1]["role"] != "assistant":
        raise OpenAIError("continue_final_message needs the last message to be an assistant message",
                          param="messages")
    last = messages[-1].get("content") or ""
    content = [*last, {"type": "text", "text": _OPEN_MARK}] if isinstance(last, list) else last + _OPEN_MARK
    marked = [*messages[:-1], {**messages[-1], "content": content}]
    rendered = tokenizer.apply_chat_template(marked, tools=tools, add_generation_prompt=False, **template_kwargs)
    cut = rendered.rfind(_OPEN_MARK)
    if cut < 0:
        raise OpenAIError("continue_final_message: the chat template does not render the final message's content",
                          param="messages")
    prompt = rendered[:cut]
    head = prompt.rfind(_ASSISTANT_OPEN)
    if head >= 0 and prompt.rfind("<|im_start|>user") < head and "<think>" not in prompt[head:]:
        start = head + len(_ASSISTANT_OPEN)
        prompt = prompt[:start] + _EMPTY_THINK + prompt[start:]
    return prompt


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
    # With images: the prompt ids, each image's pad token expanded (the engine takes these, not `prompt`).
    input_ids: list[int] | None = None
    images: list[ImageItem] | None = None

    def engine_inputs(self) -> dict[str, Any]:
        """The prompt keywords of Engine.async_generate: `text`, or `input_ids` and `images`."""
        if self.images:
            return {"input_ids": self.input_ids, "images": self.images}
        return {"text": self.prompt}

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one choice."""
        return ChatOutputParser(self.reasoning_parser, self.tool_call_parser, thinking=self.thinking,
                                tools=self.tools)


def plan_chat(engine: Engine, req: ChatCompletionRequest, reasoning: str | None, tool_parser: str | None,
              images: list[ImageItem] | None = None, image_pad: int | None = None) -> ChatPlan:
    """Render the prompt and build sampling_params (with the tool-call constraint) for a chat request.

    images: the request's images (`chat_image_refs` loaded by sglang_tpu_qwen/multimodal), whose placeholders
    the rendered prompt holds; their pad token `image_pad` is expanded in the plan's `input_ids`. Raises
    OpenAIError / InvalidRequestError (400) for a request that cannot be rendered.
    """
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
    add_generation_prompt = not req.continue_final_message if req.add_generation_prompt is None \
        else req.add_generation_prompt
    if req.continue_final_message and add_generation_prompt:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true: continue the "
                          "final message, or start a new assistant message", param="continue_final_message")
    try:
        messages = _template_messages(req)
        if req.continue_final_message:
            prompt = render_open_final(engine.tokenizer, messages, tool_dicts, template_kwargs)
        else:
            prompt = engine.tokenizer.apply_chat_template(
                messages, tools=tool_dicts, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
    except OpenAIError:
        raise
    except Exception as e:  # the template rejecting its input (raise_exception, a filter on a bad type)
        raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from None

    # The output starts inside the reasoning when the generation prompt left a <think> block open (Qwen3.5
    # with thinking on); enable_thinking false closes it, and a template without thinking never opens one.
    thinking = prompt.rstrip().endswith(THINK_START)
    input_ids = None
    if images:
        assert image_pad is not None
        input_ids = expand_image_pads(engine.tokenizer.encode(prompt), images, image_pad)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:  # SGLang: a chat without a limit may run to the end of the context
        prompt_len = len(input_ids) if input_ids is not None else len(engine.tokenizer.encode(prompt))
        max_new = max(0, engine.room_for(prompt_len))
    sampling = {**sampling_params(req, max_new), **constraint_fields(req)}
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
        input_ids=input_ids,
        images=images or None,
    )


def _new_call_id() -> str:
    """A tool call id in SGLang's form (`call_` + 24 hex chars)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_finish(meta: dict, has_tool_calls: bool) -> tuple[str | None, int | str | None]:
    """finish_reason and matched_stop of a chat choice: a natural stop after tool calls is "tool_calls"."""
    reason = finish_reason(meta)
    if reason == "stop" and has_tool_calls:
        return "tool_calls", None
    return reason, matched_stop(meta)


def chat_choice(index: int, out: dict, req: ChatCompletionRequest, plan: ChatPlan) -> ChatCompletionResponseChoice:
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
    reason, matched = chat_finish(meta, bool(calls))
    return ChatCompletionResponseChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(*logprob_lists(meta, "output")) if req.logprobs else None,
        finish_reason=reason,
        matched_stop=matched,
    )


async def stream_chat(engine: Engine, req: ChatCompletionRequest, rids: str, kwargs: dict[str, Any],
                      plan: ChatPlan) -> StreamingResponse:
    """The SSE reply of a streamed chat request: a role chunk per choice, then parsed deltas."""
    first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
    cid = f"chatcmpl-{rids}"

    def payload(choice: ChatCompletionStreamChoice) -> dict:
        return ChatCompletionStreamResponse(id=cid, model=req.model, choices=[choice]).model_dump(exclude={"usage"})

    def render(i: int, state: ChoiceStream, chunk: dict) -> list[dict]:
        out = []
        if not state.started:
            state.started, state.parser = True, plan.parser()
            out.append(payload(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))))
        meta = chunk["meta_info"]
        fr = finish_reason(meta)
        assert state.parser is not None
        delta = state.parser.feed(chunk["text"])
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
        lp = chat_logprobs(*state.take_logprobs()) if req.logprobs else None
        reason, matched = chat_finish(meta, bool(state.call_ids)) if fr is not None else (None, None)
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
            id=cid, model=req.model, choices=[], usage=usage_info(finals, req.n)
        ).model_dump()

    return openai_stream(engine, rids, first, rest, render, usage, continuous_usage(req))
