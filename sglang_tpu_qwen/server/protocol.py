"""Request and reply models of the HTTP API: SGLang's native `/generate` and the OpenAI routes.

Field names follow SGLang (`python/sglang/srt/managers/io_struct.py` GenerateReqInput and
`python/sglang/srt/entrypoints/openai/protocol.py`). Like SGLang, unknown top-level fields are ignored
(FastAPI parses SGLang's dataclass and pydantic models with extra="ignore"); fields SGLang accepts for
features this runtime lacks are accepted when empty and rejected with a 400 when set (see
`GenerateReqInput.unsupported_fields`), except routing hints (PD bootstrap, DP rank, priority...),
which only steer placement and are ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

# ---------------------------------------------------------------- SGLang native


class GenerateReqInput(BaseModel):
    """Body of `POST /generate` (SGLang's GenerateReqInput; single request or batch)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    # StrictInt: JSON true/false are not token ids (pydantic's lax mode would read true as 1).
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    # The output starts inside the model's reasoning: a constraint applies after the reasoning ends.
    require_reasoning: bool = False

    # Accepted and ignored: routing / bookkeeping hints that do not change the output.
    log_metrics: bool = True
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    bootstrap_pair_key: str | list[str | None] | None = None
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    session_id: str | None = None
    custom_labels: dict[str, str] | None = None
    no_logs: bool = False
    modalities: list[str] | None = None
    received_time: float | None = None

    # Images (sglang_tpu_qwen/multimodal): one reference (data: URL, base64, path, URL) or a list of them for a
    # single prompt; for a batch, one entry (a reference, a list, or null) per prompt.
    image_data: str | list[str | list[str] | None] | None = None

    # Accepted only when empty: features that would change the output.
    input_embeds: list[Any] | None = None
    video_data: Any = None
    audio_data: Any = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_hidden_states: bool | list[bool] | str = False
    session_params: dict[str, Any] | None = None
    lora_path: str | list[str | None] | None = None
    lora_id: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None

    def unsupported_fields(self) -> list[str]:
        """Names of fields set to a value this runtime cannot honour (each makes the request a 400)."""
        names = (
            "input_embeds",
            "video_data",
            "audio_data",
            "token_ids_logprob",
            "session_params",
            "lora_path",
            "lora_id",
            "custom_logit_processor",
        )
        bad = [n for n in names if _is_set(getattr(self, n))]
        if _is_set(self.return_hidden_states):
            bad.append("return_hidden_states")
        return bad


def _is_set(value: Any) -> bool:
    """True when a value is neither None/False nor an empty or all-None/False list."""
    if isinstance(value, list):
        return any(_is_set(v) for v in value)
    return value is not None and value is not False


class AbortReq(BaseModel):
    """Body of `POST /abort_request`."""

    rid: str = ""
    abort_all: bool = False


# ---------------------------------------------------------------- OpenAI: shared

DEFAULT_MODEL_NAME = "default"


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Reply of `GET /v1/models`."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorResponse(BaseModel):
    """Error body used by SGLang's OpenAI routes and validation errors."""

    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """`usage` of a reply: token counts of the whole request (all choices)."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _SamplingFields(BaseModel):
    """Sampling fields shared by the completion and chat requests (SGLang extensions included)."""

    model_config = ConfigDict(extra="ignore")

    model: str = DEFAULT_MODEL_NAME
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    min_tokens: StrictInt = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[StrictInt] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    rid: str | list[str] | None = None
    # Routing hints, ignored (see module docstring).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    lora_path: str | list[str | None] | None = None
    # Constrained decoding: SGLang's extra fields and OpenAI's response_format (at most one constraint).
    regex: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        """Names of set fields this runtime cannot honour (each makes the request a 400)."""
        names = ("lora_path",)
        return [n for n in names if _is_set(getattr(self, n))]


# ---------------------------------------------------------------- OpenAI: completions


class CompletionRequest(_SamplingFields):
    """Body of `POST /v1/completions`."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    logprobs: StrictInt | None = None
    max_tokens: StrictInt = Field(16, ge=0)  # checked here so the error names the OpenAI field
    suffix: str | None = None
    best_of: StrictInt | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0

    def unsupported_fields(self) -> list[str]:
        """As the base class, plus `suffix` (insertion is not implemented) and `best_of` other than n
        (ranking samples by logprob is not implemented; best_of == n is plain sampling)."""
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad


class LogProbs(BaseModel):
    """Completion-style logprobs of one choice."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "abort"]


class CompletionResponseChoice(BaseModel):
    """One choice of a completion reply (or, with a partial `text`, of a streamed chunk)."""

    index: int
    text: str
    logprobs: LogProbs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    """Reply of `POST /v1/completions` (`object` "text_completion"; chunks share the shape)."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- OpenAI: chat


class ImageURL(BaseModel):
    """`image_url` of an image content part: a data: URL, a base64 string, a local path or an http(s) URL
    (sglang_tpu_qwen/multimodal/image_source.py says which the server takes); `detail` is accepted and ignored
    (the checkpoint's processor sets the resolution)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    """One part of a list-valued message content: `text`, or `image_url` (an image)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(BaseModel):
    """`function` of a tool call: name and JSON-encoded arguments."""

    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    """A tool call in an assistant message or reply."""

    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One input message; `content` is a string or a list of parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class FunctionDef(BaseModel):
    """A function a tool exposes."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False


class Tool(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(BaseModel):
    """`tool_choice.function`."""

    name: str


class ToolChoice(BaseModel):
    """A named `tool_choice`."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    max_tokens: StrictInt | None = Field(None, ge=0)  # checked here so the error names the OpenAI field
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # SGLang / HF: render the last (assistant) message open so the model continues it; a generation prompt
    # (add_generation_prompt, true unless continue_final_message) cannot go with it (a 400).
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None


class TopLogprob(BaseModel):
    """One alternative token in chat logprobs."""

    token: str
    bytes: list[int]
    logprob: float


class ChatCompletionTokenLogprob(BaseModel):
    """Logprob of one generated token in chat logprobs."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """`logprobs` of one chat choice."""

    content: list[ChatCompletionTokenLogprob]


class ChatCompletionMessage(BaseModel):
    """The assistant message of a chat choice."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(BaseModel):
    """One choice of a chat reply."""

    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Reply of `POST /v1/chat/completions`."""

    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The incremental message of a streamed chat chunk."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """A streamed chat chunk (`object` "chat.completion.chunk")."""

    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
