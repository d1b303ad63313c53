"""The FastAPI application: SGLang's native routes plus the OpenAI routes, over one in-process Engine.

Routes (as SGLang's `python/sglang/srt/entrypoints/http_server.py`):
  POST/PUT /generate        text | input_ids, single or batch, with image_data (server/image_fields.py); SSE when
                            stream: cumulative text (deltas with --incremental-streaming-output), per-chunk
                            logprob lists (sse.NativeChunks)
  GET /get_model_info, /model_info      model_path, tokenizer_path, is_generation, served_model_name
  GET /get_server_info, /server_info    server args + engine state + version
  GET /health                           200, empty body; 503 (reason as text) before warm-up has passed, when the
                                        scheduler thread is dead or failed fatally, or a step has run longer
                                        than --watchdog-timeout (engine/observability/health.py)
  GET /health_generate                  as /health, then 200 once a 1-token generation returns; 503 otherwise
  GET/POST /flush_cache                 200 "Cache flushed..." or 400 when requests are running
  POST /abort_request                   {"rid"}: abort that request
  GET/POST /start_profile, /stop_profile  jax.profiler trace of the scheduler's steps
                                        (engine/observability/profiler.py); plain-text reply naming the trace
                                        directory, 400 when one already runs
  GET /metrics                          Prometheus text (only with --enable-metrics)
  /v1/models, /v1/completions, /v1/chat/completions   see openai_api.py
`/version` is deliberately absent (404): SGLang routers take a worker answering it for vLLM.
With an api key, every route but /health, /health_generate and (with --enable-metrics) /metrics needs
`Authorization: Bearer KEY` (else 401), compared in constant time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.multimodal.image_inputs import ImageInputs
from sglang_tpu_qwen.multimodal.media_limits import MediaLimits
from sglang_tpu_qwen.server import engine_calls
from sglang_tpu_qwen.server.engine_calls import ClientDisconnected
from sglang_tpu_qwen.server.errors import install_error_handlers, native_error, unauthorized
from sglang_tpu_qwen.server.image_fields import with_images
from sglang_tpu_qwen.server.openai_api import create_openai_router
from sglang_tpu_qwen.server.protocol import AbortReq, GenerateReqInput
from sglang_tpu_qwen.server.request_fields import bootstrap_kwargs
from sglang_tpu_qwen.server.sse import NativeChunks, add_logprob_length, stream_response

if TYPE_CHECKING:
    from sglang_tpu_qwen.engine.engine import Engine

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
PROFILE_WAIT_S = 120.0


def _scalar(value: Any, name: str) -> Any:
    """A per-batch-member list of identical values collapses to one value; differing values are a 400."""
    if isinstance(value, list):
        if len(set(map(repr, value))) > 1:
            raise InvalidRequestError(f"{name}: different values per batch member are not supported")
        return value[0] if value else None
    return value


def _generate_kwargs(obj: GenerateReqInput) -> tuple[dict[str, Any], int | None]:
    """Engine keyword arguments for a /generate body, and its batch size (None for a single request)."""
    unsupported = obj.unsupported_fields()
    if unsupported:
        raise InvalidRequestError(f"Unsupported field(s) for this server: {', '.join(unsupported)}")
    if obj.text is None and obj.input_ids is None:
        raise InvalidRequestError("Either text or input_ids should be provided.")
    if obj.text is not None and obj.input_ids is not None:
        raise InvalidRequestError("Only one of text or input_ids should be provided.")
    batch_size = None
    if isinstance(obj.text, list):
        batch_size = len(obj.text)
    elif obj.input_ids and isinstance(obj.input_ids[0], list):
        batch_size = len(obj.input_ids)
    if batch_size == 0:
        raise InvalidRequestError("The batch is empty.")
    sampling = obj.sampling_params
    if isinstance(sampling, list) and batch_size is not None and len(sampling) != batch_size:
        raise InvalidRequestError(f"sampling_params has {len(sampling)} entries for a batch of {batch_size}")
    if isinstance(sampling, list) and batch_size is None:
        sampling = _scalar(sampling, "sampling_params")
    kwargs = dict(
        text=obj.text,
        input_ids=obj.input_ids,
        sampling_params=sampling,
        return_logprob=bool(_scalar(obj.return_logprob, "return_logprob")),
        logprob_start_len=_scalar(obj.logprob_start_len, "logprob_start_len"),
        top_logprobs_num=_scalar(obj.top_logprobs_num, "top_logprobs_num") or 0,
        return_text_in_logprobs=obj.return_text_in_logprobs,
        **({"require_reasoning": True} if obj.require_reasoning else {}),
        **bootstrap_kwargs(obj),  # PD disaggregation: injected by the router into both legs
    )
    return kwargs, batch_size


def create_app(engine: Engine, *, api_key: str | None = None, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None, media_limits: MediaLimits | None = None) -> FastAPI:
    """Build the HTTP app over an Engine (contract: docs/internals.md, "Engine API used by the HTTP server").

    Args:
      engine: the in-process Engine.
      api_key: overrides `engine.server_args.api_key` when given (a test can serve one engine twice).
      reasoning_parser / tool_call_parser: override `--reasoning-parser` / `--tool-call-parser` of
        `engine.server_args` for the OpenAI chat route (same purpose).
      media_limits: override the image-input flags of `engine.server_args` (same purpose).
    """
    app = FastAPI(title="sglang-tpu-qwen", openapi_url="/openapi.json")
    app.state.engine = engine
    images = ImageInputs.for_engine(engine, media_limits)  # the checkpoint's image processor, loaded once
    install_error_handlers(app)
    key = api_key if api_key is not None else getattr(engine.server_args, "api_key", None)

    if key:
        expected = f"Bearer {key}".encode()
        # /metrics is open to scrapers only where it exists (--enable-metrics); elsewhere it is a 401 like any path.
        open_paths = {"/health", "/health_generate"} | ({"/metrics"} if getattr(engine, "metrics", None) else set())

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            exempt = request.method == "OPTIONS" or request.url.path in open_paths
            # Constant-time comparison: the time taken says nothing about how much of a guess was right.
            given = request.headers.get("Authorization", "").encode()
            if not exempt and not hmac.compare_digest(given, expected):
                return unauthorized()
            return await call_next(request)

    def problem() -> str | None:
        return engine.health().problem(getattr(engine.server_args, "watchdog_timeout", None))

    @app.get("/health")
    async def health() -> Response:
        reason = problem()
        if reason is not None:
            return Response(content=f"unhealthy: {reason}\n", status_code=503, media_type="text/plain")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        reason = problem()
        if reason is not None:
            return Response(content=f"unhealthy: {reason}\n", status_code=503, media_type="text/plain")
        rid = f"HEALTH_CHECK_{engine_calls.new_rid()}"
        try:
            await asyncio.wait_for(
                engine_calls.generate_once(
                    engine,
                    request,
                    rid,
                    input_ids=[0],
                    sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                ),
                timeout=HEALTH_CHECK_TIMEOUT_S,
            )
        except (TimeoutError, ClientDisconnected):
            engine.abort(rid)
            return Response(status_code=503)
        except Exception:
            logger.exception("health_generate failed")
            return Response(status_code=503)
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "tokenizer_path": getattr(engine.server_args, "tokenizer_path", None) or engine.model_path,
            "is_generation": True,
            "served_model_name": engine.served_model_name,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    app.add_api_route("/get_model_info", model_info, methods=["GET"])
    app.add_api_route("/model_info", model_info, methods=["GET"])

    def server_info() -> dict[str, Any]:
        info = dict(engine.get_server_info())
        if "api_key" in info:  # never echo the secret
            info["api_key"] = None if info["api_key"] is None else "***"
        info.setdefault("context_length", engine.context_length)
        return info

    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])

    async def flush_cache() -> Response:
        ok = await asyncio.to_thread(engine.flush_cache)  # waits for the scheduler thread
        if ok:
            return Response(content="Cache flushed.\n", status_code=200)
        return Response(content="Cache not flushed: requests are running or waiting. Retry when idle.\n",
                        status_code=400)

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        if obj.abort_all:
            engine.abort_all()
        elif obj.rid:
            engine.abort(obj.rid)
        return Response(status_code=200)

    if getattr(engine, "metrics", None) is not None:

        @app.get("/metrics")
        async def metrics() -> Response:
            body, content_type = engine.metrics.render()
            return Response(content=body, media_type=content_type)

    async def start_profile(request: Request) -> Response:
        """SGLang's /start_profile: a jax.profiler trace of the scheduler's steps (engine/observability/profiler.py)."""
        raw = await request.body()
        body = json.loads(raw) if raw.strip() else None  # a JSONDecodeError is a 400 (utils/errors.py)
        if body is not None and not isinstance(body, dict):
            raise InvalidRequestError("the /start_profile body must be a JSON object")
        return await _profile_reply(engine.start_profile(body))

    async def stop_profile() -> Response:
        """SGLang's /stop_profile: end the trace and write its files."""
        return await _profile_reply(engine.stop_profile())

    app.add_api_route("/start_profile", start_profile, methods=["GET", "POST"])
    app.add_api_route("/stop_profile", stop_profile, methods=["GET", "POST"])

    async def generate(obj: GenerateReqInput, request: Request) -> Any:
        kwargs, batch_size = _generate_kwargs(obj)
        if obj.image_data is not None:
            kwargs = await with_images(engine, images, kwargs, obj.image_data, batch_size)
        try:
            rids = engine_calls.make_rids(obj.rid, batch_size)
        except ValueError as e:
            return native_error(str(e))
        if not obj.stream:
            try:
                out = await engine_calls.generate_once(engine, request, rids, **kwargs)
                for reply in out if isinstance(out, list) else [out]:
                    add_logprob_length(reply["meta_info"])
                return out
            except ClientDisconnected:
                return native_error("client disconnected", 499)
        first, rest = await engine_calls.open_stream(engine, rids, **kwargs)
        render = NativeChunks(bool(getattr(engine.server_args, "incremental_streaming_output", False)))
        return stream_response(engine, rids, first, rest, render, openai=False)

    app.add_api_route("/generate", generate, methods=["POST", "PUT"])
    app.include_router(create_openai_router(engine, reasoning_parser=reasoning_parser,
                                            tool_call_parser=tool_call_parser, images=images))
    return app


async def _profile_reply(fut: concurrent.futures.Future) -> Response:
    """The scheduler thread's answer to a profile request, as SGLang's plain-text reply; it acts between two
    steps, so a long step (a compilation) delays it. A request not acted on within PROFILE_WAIT_S is withdrawn."""
    try:
        text = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), PROFILE_WAIT_S)
    except TimeoutError:
        if fut.cancel():
            return native_error(f"the scheduler did not take the profile request within {PROFILE_WAIT_S:g} s", 503)
        text = await asyncio.wrap_future(fut)  # it started meanwhile: wait for its answer
    return Response(content=text, status_code=200, media_type="text/plain")


__all__ = ["create_app"]
