"""The FastAPI application: routes, OpenAI error bodies, SSE streaming, API key, metrics, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvpop.openai_api.body import MAX_BODY_BYTES, read_body
from kvpop.openai_api.engine_client import Delta, EngineClient, EngineError, EngineRequest
from kvpop.openai_api.errors import ERROR_STATUS, APIError
from kvpop.openai_api.schemas import ChatCompletionRequest, CompletionRequest, RequestError

T = TypeVar("T")
UNKNOWN_ROUTE = "unknown"  # the `route` label of every path no route serves (labels must stay few)


@dataclass
class Settings:
    triton_grpc_url: str = "127.0.0.1:8001"
    engine_model: str = "kvpop_engine"  # the Triton model answering; also the model id clients name
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer <key>`
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies are refused (413) before they are read


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvpop_openai_requests", "OpenAI API requests by route template and HTTP status",
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

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own answers (no such route: 404, a route without this method: 405) in OpenAI's body."""
        message = f"{error.detail}: {request.method} {request.url.path}"
        return APIError(error.status_code, message, "invalid_request_error").response(error.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(error).__name__}", "server_error").response()

    app.add_middleware(AuthenticateAndCount, settings=settings, metrics=metrics, routes=app.router.routes)

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
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        return await answer(request, body, _translate(body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, settings.max_body_bytes)
        check_model(body.model)
        return await answer(request, body, _translate(body), chat=False)

    async def answer(request: Request, body, engine_request: EngineRequest, chat: bool) -> Response:
        route, started = request.url.path, time.perf_counter()  # a fixed path: one of the two routes above
        deltas = engine.generate(engine_request)
        metrics.in_flight.inc()
        try:
            first = await _unless_disconnected(request, _first_delta(deltas))  # errors keep their HTTP status
        except BaseException:
            metrics.in_flight.dec()
            raise
        if first is None:  # the client left while the request was queued or its prompt prefilled
            metrics.in_flight.dec()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        metrics.first_token.labels(route).observe(time.perf_counter() - started)
        shape = _Shape(chat=chat, model=settings.engine_model)
        if body.stream:  # from here on StreamingResponse notices a disconnect and closes `deltas`
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(shape, first, deltas, include_usage, metrics, route, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            collected = await _unless_disconnected(request, _collect(first, deltas))
        finally:
            metrics.in_flight.dec()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
        if collected is None:
            return Response(status_code=499)
        text, last = collected
        metrics.tokens.labels("prompt").inc(last.prompt_tokens)
        metrics.tokens.labels("completion").inc(last.completion_tokens)
        return JSONResponse(shape.complete(text, last))

    return app


class AuthenticateAndCount:
    """Checks the API key of /v1 requests and counts them by route template and status (a path no route
    serves counts as UNKNOWN_ROUTE: a client must not be able to make new series). A plain ASGI
    middleware: Starlette's BaseHTTPMiddleware would hide a client's disconnect from the routes behind it."""

    def __init__(self, app, settings: Settings, metrics: Metrics, routes: list) -> None:
        self.app, self.settings, self.metrics, self.routes = app, settings, metrics, routes

    def _template(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path is served, the method is not (405)
                return route.path
        return UNKNOWN_ROUTE

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        route = self._template(scope)
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


async def _collect(first: Delta, deltas: AsyncIterator[Delta]) -> tuple[str, Delta]:
    """The whole answer: its text and its last delta (finish reason, usage, cache statistics)."""
    parts, last = [first.text], first
    try:
        async for delta in deltas:
            parts.append(delta.text)
            last = delta
    except EngineError as error:
        raise APIError.from_engine(error) from None
    return "".join(parts), last


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """What `work` returns, or None as soon as the client disconnects (at any stage: its request queued,
    its prompt prefilling, its answer generating). `work` is then cancelled: the engine stream's `finally`
    cancels the Triton request, and the engine drops it from its queue or frees its slots at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        for pending in (task, gone):
            pending.cancel()


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read: the server's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
