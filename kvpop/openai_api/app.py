"""The FastAPI application: routes, OpenAI error bodies, SSE streaming, API key, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpop.openai_api.engine_client import Delta, EngineClient, EngineError, EngineRequest
from kvpop.openai_api.schemas import ChatCompletionRequest, CompletionRequest, RequestError

# kvpop.serving.errors kind -> (HTTP status, OpenAI error type)
ERROR_STATUS = {
    "invalid": (400, "invalid_request_error"),
    "overloaded": (503, "service_unavailable"),
    "internal": (500, "server_error"),
}
DISCONNECT_POLL_S = 0.25  # how often a complete (non-streamed) answer checks that its client is still there


@dataclass
class Settings:
    triton_grpc_url: str = "127.0.0.1:8001"
    engine_model: str = "kvpop_engine"  # the Triton model answering; also the model id clients name
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer <key>`


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)

    @classmethod
    def from_engine(cls, error: EngineError) -> "APIError":
        status, error_type = ERROR_STATUS[error.kind]
        return cls(status, str(error), error_type)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvpop_openai_requests", "OpenAI API requests by route and HTTP status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("kvpop_openai_request_seconds", "OpenAI API request latency (to the last byte)",
                                 ["route"], registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.first_token = Histogram("kvpop_openai_time_to_first_token_seconds", "Time to the first streamed token",
                                     ["route"], registry=self.registry,
                                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.in_flight = Gauge("kvpop_openai_requests_in_flight", "OpenAI API requests being answered",
                               registry=self.registry)
        self.tokens = Counter("kvpop_openai_tokens", "Prompt and completion tokens", ["kind"], registry=self.registry)


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="KVpop Serve OpenAI-compatible API", docs_url=None, redoc_url=None)
    engine = EngineClient(settings.triton_grpc_url, settings.engine_model)
    metrics = Metrics()
    app.state.engine, app.state.metrics = engine, metrics

    @app.on_event("shutdown")
    async def close_engine() -> None:
        await engine.close()

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
        return APIError(400, message, "invalid_request_error", param).response()

    app.add_middleware(AuthenticateAndCount, settings=settings, metrics=metrics)

    def check_model(model: str) -> None:
        if model != settings.engine_model:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {settings.engine_model!r}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(settings.engine_model)]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict:
        check_model(model)
        return _model_card(model)

    @app.get("/health")
    async def health() -> Response:
        ready = await engine.is_ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await answer(request, body, _translate(body), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await answer(request, body, _translate(body), chat=False)

    async def answer(request: Request, body, engine_request: EngineRequest, chat: bool) -> Response:
        route, started = request.url.path, time.perf_counter()
        deltas = engine.generate(engine_request)
        metrics.in_flight.inc()
        try:
            first = await _first_delta(deltas)  # errors before the first token keep their HTTP status
        except BaseException:
            metrics.in_flight.dec()
            raise
        metrics.first_token.labels(route).observe(time.perf_counter() - started)
        shape = _Shape(chat=chat, model=settings.engine_model)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(shape, first, deltas, include_usage, metrics, route, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            collected = await _collect_unless_disconnected(request, first, deltas)
        finally:
            metrics.in_flight.dec()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
        if collected is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        text, last = collected
        metrics.tokens.labels("prompt").inc(last.prompt_tokens)
        metrics.tokens.labels("completion").inc(last.completion_tokens)
        return JSONResponse(shape.complete(text, last))

    return app


class AuthenticateAndCount:
    """Checks the API key of /v1 requests and counts them by route and status. A plain ASGI middleware:
    Starlette's BaseHTTPMiddleware would hide a client's disconnect from the routes behind it."""

    def __init__(self, app, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send) -> None:
        route = scope.get("path", "")
        if scope["type"] != "http" or not route.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.settings.api_key:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.settings.api_key.encode()):
                self.metrics.requests.labels(route, "401").inc()
                error = APIError(401, "missing or incorrect API key (Authorization: Bearer <key>)",
                                 "invalid_request_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        status = {"code": 500}

        async def send_and_note_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.metrics.requests.labels(route, str(status["code"])).inc()


def _translate(body: ChatCompletionRequest | CompletionRequest) -> EngineRequest:
    try:
        return body.to_engine()
    except RequestError as error:
        raise APIError(400, str(error), "invalid_request_error", error.param) from None


def _model_card(model: str) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvpop-serve"}


async def _first_delta(deltas: AsyncIterator[Delta]) -> Delta:
    try:
        return await deltas.__anext__()
    except EngineError as error:
        raise APIError.from_engine(error) from None
    except StopAsyncIteration:
        raise APIError(500, "the engine sent no response", "server_error") from None


async def _collect_unless_disconnected(request: Request, first: Delta, deltas: AsyncIterator[Delta]):
    """The whole answer, or None when the client disconnected first (the generation is then cancelled)."""
    async def collect() -> tuple[str, Delta]:
        parts, last = [first.text], first
        async for delta in deltas:
            parts.append(delta.text)
            last = delta
        return "".join(parts), last

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()  # thrown into the engine stream, whose `finally` cancels the Triton request
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()
    except EngineError as error:
        raise APIError.from_engine(error) from None
    finally:
        if not task.done():
            task.cancel()


@dataclass
class _Shape:
    """OpenAI's response objects for chat or text completions."""

    chat: bool
    model: str

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def complete(self, text: str, last: Delta) -> dict:
        body = self._envelope([self._choice(text, _finish_reason(last), chunk=False)], chunk=False)
        return {**body, "usage": _usage(last), "kvpop": last.cache}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        return self._envelope([self._choice(text, finish_reason, chunk=True, role=role)], chunk=True)

    def usage_chunk(self, last: Delta) -> dict:
        return {**self._envelope([], chunk=True), "usage": _usage(last)}


def _finish_reason(delta: Delta) -> str:
    return "length" if delta.finish_reason == "length" else "stop"


def _usage(delta: Delta) -> dict:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens}


async def _sse(shape: _Shape, first: Delta, deltas: AsyncIterator[Delta], include_usage: bool, metrics: Metrics,
               route: str, started: float) -> AsyncIterator[str]:
    """SSE events: a chunk per delta, the finish reason (with the cache statistics), usage if asked, [DONE].
    When the client disconnects, Starlette cancels this generator and `deltas` closes its gRPC stream."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    try:
        last = first
        if shape.chat:
            yield event(shape.chunk("", role=True))
        delta = first
        try:
            while True:
                last = delta
                if delta.finish_reason is not None:
                    final = shape.chunk(delta.text or None, _finish_reason(delta))
                    yield event({**final, "kvpop": delta.cache})
                    break
                if delta.text:
                    yield event(shape.chunk(delta.text))
                delta = await deltas.__anext__()
        except EngineError as error:
            status, error_type = ERROR_STATUS[error.kind]
            yield event({"error": {"message": str(error), "type": error_type, "param": None, "code": str(status)}})
        except StopAsyncIteration:
            pass
        if include_usage:
            yield event(shape.usage_chunk(last))
        metrics.tokens.labels("prompt").inc(last.prompt_tokens)
        metrics.tokens.labels("completion").inc(last.completion_tokens)
        yield "data: [DONE]\n\n"
    finally:
        await deltas.aclose()
        metrics.in_flight.dec()
        metrics.latency.labels(route).observe(time.perf_counter() - started)
