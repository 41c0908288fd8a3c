"""The FastAPI app of an OpenAIIngress instance: routes, SSE streaming, OpenAI error objects.

Routes: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions,
GET /health. Every error, including FastAPI's own validation errors and unknown routes, comes out as
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.errors import APIError, AuthenticationError, EngineError, RequestTooLargeError, error_body
from deployments.ingress.schemas import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-replica-id"


def build_fastapi_app(ingress: Any, settings: Any) -> FastAPI:
    """Routes bound to `ingress` (an OpenAIIngress); `settings` is its IngressSettings."""
    app = FastAPI(title="mlx-serve", description="OpenAI-compatible API over MLX engines")
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    auth = [Depends(api_key_checker(settings.api_key))]

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> JSONResponse:
        return JSONResponse((await ingress.models()).model_dump(mode="json"))

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def get_model(model: str) -> JSONResponse:
        ingress.check_model(model)
        return JSONResponse((await ingress.models()).data[0].model_dump(mode="json"))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest) -> Any:
        return await respond(body, ingress.completions, ingress.completions_stream)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return await respond(body, ingress.chat, ingress.chat_stream)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse((await ingress.health()).model_dump(mode="json"))

    return app


async def respond(body: Any, complete: Callable[[Any], Awaitable[Any]],
                  stream: Callable[[Any], AsyncIterator[Any]]) -> Any:
    """JSON for a plain request; SSE for stream=true, started only once the first chunk exists, so
    errors before any output (bad prompt, no replica) still get their HTTP status."""
    if not body.stream:
        response = await complete(body)
        return JSONResponse(response.model_dump(mode="json"), headers=_replica_header(response))
    chunks = stream(body)
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        raise EngineError("the engine produced no output") from None
    return StreamingResponse(sse_events(first, chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **_replica_header(first)})


async def sse_events(first: Any, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """`data: {chunk}` events, then `data: [DONE]`; a failure mid-stream ends with an error event and
    no [DONE], so a client never mistakes a broken stream for a complete one."""
    try:
        yield f"data: {first.model_dump_json()}\n\n"
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.to_dict())}\n\n"
    except Exception as e:
        logger.exception("stream failed")
        yield f"data: {json.dumps(EngineError(f'{type(e).__name__}: {e}').to_dict())}\n\n"
    finally:
        await chunks.aclose()  # on client disconnect: cancels the replica call, which aborts the engine


def _replica_header(response: Any) -> dict[str, str]:
    fingerprint = getattr(response, "system_fingerprint", None)
    return {REPLICA_HEADER: fingerprint} if fingerprint else {}


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(str(exc.detail), "invalid_request_error", None, None)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(EngineError(f"{type(exc).__name__}: {exc}").to_dict(), status_code=500)


def validation_body(errors: Any) -> dict[str, Any]:
    """A pydantic / FastAPI error list as one OpenAI error object; param is the first bad field."""
    errors = list(errors)
    if not errors:
        return error_body("invalid request", "invalid_request_error")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error_body(f"invalid JSON body: {first.get('msg')}", "invalid_request_error", None,
                          "invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):  # [..], "..", 3
        return error_body("the request body must be a JSON object", "invalid_request_error", None,
                          "invalid_body")
    messages = "; ".join(_describe(e) for e in errors[:5])
    return error_body(messages, "invalid_request_error", param, first.get("type"))


def _describe(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))


def api_key_checker(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise AuthenticationError("Incorrect or missing API key", code="invalid_api_key")

    return check


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` (by Content-Length, or while reading a chunked body)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await JSONResponse(self._error().to_dict(), status_code=413)(scope, receive, send)
            return
        # Read the body here, up to the limit: an error raised from inside the app's receive would reach
        # FastAPI's body parser and come out as a 400, not the 413 it is.
        buffered: list[dict] = []
        received = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await JSONResponse(self._error().to_dict(), status_code=413)(scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay_receive() -> dict:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay_receive, send)

    def _error(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"request body is over {self.max_bytes} bytes", code="request_too_large")
