"""Error replies in the shapes SGLang's server uses.

- OpenAI routes and request-validation failures: `{"object": "error", "message", "type", "param",
  "code"}` (SGLang's ErrorResponse), status 400 / 404.
- Native routes (`/generate`): `{"error": {"message": ...}}` with status 400, as SGLang's
  `_create_error_response`.
- Bad or missing api key: 401 `{"error": "Unauthorized"}`, as SGLang's api-key middleware.
- A request the server failed (engine.errors.RequestFailedError, status 500 / 503): the OpenAI routes answer
  an ErrorResponse with `type` the err_type; `/generate` answers `{"error": {"message", "type", "code"}}`.
  Inside an already started stream the same objects come as one `data: {"error": ...}` event, then
  `data: [DONE]` (`stream_error_event`), as SGLang's serving_chat / http_server do.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError, RequestFailedError
from sglang_tpu_qwen.server.protocol import ErrorResponse
from sglang_tpu_qwen.utils.errors import TransferError


class OpenAIError(Exception):
    """Raised inside an OpenAI route to answer with an ErrorResponse of the given status."""

    def __init__(
        self, message: str, status: int = 400, err_type: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or _default_type(status)
        self.param = param


def _default_type(status: int) -> str:
    named = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 499: "ClientClosedRequest"}
    if status in named:
        return named[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:  # a non-standard status
        return "Error"


def openai_error(
    message: str, status: int = 400, err_type: str | None = None, param: str | None = None
) -> JSONResponse:
    """An OpenAI-shaped error reply."""
    body = ErrorResponse(message=message, type=err_type or _default_type(status), param=param, code=status)
    return JSONResponse(body.model_dump(), status_code=status)


def native_error(message: str, status: int = 400) -> JSONResponse:
    """A native-route error reply (`{"error": {"message": ...}}`)."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def failure_body(message: str, status: int, err_type: str, openai: bool) -> dict:
    """The error object of a failed request: OpenAI's ErrorResponse, or the native `{"error": {...}}`."""
    if openai:
        return ErrorResponse(message=message, type=err_type, code=status).model_dump()
    return {"error": {"message": message, "type": err_type, "code": status}}


def stream_error_event(reason: dict, openai: bool) -> dict:
    """The `data:` payload that ends a stream whose request the server failed (finish_reason `reason`, an
    abort with a status_code): `{"error": <ErrorResponse>}` on the OpenAI routes, `{"error": {...}}` natively."""
    message = str(reason.get("message") or "request failed")
    status = int(reason.get("status_code") or 500)
    err_type = str(reason.get("err_type") or _default_type(status))
    body = failure_body(message, status, err_type, openai)
    return {"error": body} if openai else body


def unauthorized() -> JSONResponse:
    """The 401 reply to a missing or wrong api key."""
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


def model_not_found(model: str) -> OpenAIError:
    """The 404 error for an OpenAI request naming a model this server does not serve."""
    return OpenAIError(
        f"The model {model} does not exist.", status=404, err_type="NotFoundError", param="model"
    )


def _validation_message(exc: RequestValidationError) -> str:
    """One readable line per validation error, e.g. `body.top_p: Input should be a valid number`."""
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"Invalid JSON in request body: {ctx.get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Map validation failures, engine refusals and HTTP errors onto SGLang's error shapes."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_error(_validation_message(exc), 400)

    @app.exception_handler(json.JSONDecodeError)
    async def _on_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return openai_error(f"Invalid JSON in request body: {exc}", 400)

    @app.exception_handler(OpenAIError)
    async def _on_openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return openai_error(exc.message, exc.status, exc.err_type, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            return openai_error(str(exc), 400)
        return native_error(str(exc), 400)

    @app.exception_handler(TransferError)
    async def _on_transfer(request: Request, exc: TransferError) -> JSONResponse:
        # A PD transfer that failed (lost prefill server, timeout, layout mismatch): its own status.
        if request.url.path.startswith("/v1/"):
            return openai_error(exc.message, exc.status)
        return native_error(exc.message, exc.status)

    @app.exception_handler(RequestFailedError)
    async def _on_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        body = failure_body(exc.message, exc.status, exc.err_type, request.url.path.startswith("/v1/"))
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return openai_error(str(exc.detail), exc.status_code)
