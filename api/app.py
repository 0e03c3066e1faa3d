"""The HTTP routes of `swarm-api`: OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions`, and the
live swarm page (`/`, plain HTML, CSS and JS from `api/static`, no build step) over `/api/v1/swarm`, and Prometheus
metrics at `/metrics`.

FastAPI on uvicorn, as vLLM's OpenAI server uses: request bodies are pydantic models (the project's records are
too), and server-sent events are a plain streaming response. Streaming follows OpenAI's chunk format: a first chunk
with the assistant's role (chat), then content deltas, a last chunk with the finish reason, with
`stream_options.include_usage` a chunk of usage and no choices, then `data: [DONE]`. A stream's errors before the
first token are HTTP errors like any other; after it, an `{"error": ...}` event ends the stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.engine import Delta, Engine
from api.errors import ApiError, bad_request, unknown_model
from api.metrics import ApiMetrics
from api.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest, model_card, new_id, now, usage
from api.swarm_view import SwarmWatcher

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STATIC = Path(__file__).parent / "static"


def create_app(engine: Engine, watcher: SwarmWatcher) -> FastAPI:
    """Gives the ASGI app serving `engine`'s model, and the live page of the swarm `watcher` reads."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        watcher.start()
        try:
            yield
        finally:
            await watcher.stop()

    app = FastAPI(title="chainswarm", description="An OpenAI-compatible API in front of a chainswarm swarm",
                  lifespan=lifespan)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(CountRequests, metrics=engine.metrics)
    started = now()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return api_error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return api_error_response(bad_request(message, param=param))

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/v1/swarm")
    async def swarm() -> dict[str, Any]:
        return watcher.view()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(engine.names[0], started)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(engine, name)
        return model_card(engine.names[0], started)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        check_model(engine, body.model)
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        prompt = engine.chat_prompt(messages)
        limit = body.token_limit()
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        deltas = start(engine, body, prompt, await engine.budget(prompt, limit, param))
        first = await anext(deltas)  # errors before the first token are HTTP errors
        request_id, created, name = new_id("chatcmpl"), now(), engine.names[0]

        def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> dict[str, Any]:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

        if body.stream:
            return stream(deltas, first, body, len(prompt), opening=chunk({"role": "assistant", "content": ""}, None),
                          make=lambda delta: chunk({"content": delta.text} if delta.text else {}, delta.finish_reason),
                          usage_chunk=lambda counts: {**chunk({}, None), "choices": [], "usage": counts})
        text, last = await collect(deltas, first)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": last.finish_reason}],
            "usage": usage(len(prompt), last.tokens),
        })

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        check_model(engine, body.model)
        prompt = engine.text_prompt(body.text())
        deltas = start(engine, body, prompt, await engine.budget(prompt, body.max_tokens, "max_tokens"))
        first = await anext(deltas)
        request_id, created, name = new_id("cmpl"), now(), engine.names[0]

        def chunk(text: str, finish: str | None, **extra: Any) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}

        if body.stream:
            return stream(deltas, first, body, len(prompt), opening=None,
                          make=lambda delta: chunk(delta.text, delta.finish_reason),
                          usage_chunk=lambda counts: {**chunk("", None), "choices": [], "usage": counts})
        text, last = await collect(deltas, first)
        return JSONResponse({**chunk(text, last.finish_reason), "usage": usage(len(prompt), last.tokens)})

    return app


class CountRequests:
    """ASGI middleware: counts each HTTP request by route and status, and times it to its last byte (a stream's
    last event)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before it answers

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "other")  # the route's template, never the raw path: bounded labels
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - started)


def api_error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def check_model(engine: Engine, name: str) -> None:
    if name not in engine.names:
        raise unknown_model(name)


def start(engine: Engine, body: SamplingRequest, prompt: list[int], max_new_tokens: int) -> AsyncIterator[Delta]:
    return engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                           seed=body.seed, stops=body.stops())


async def collect(deltas: AsyncIterator[Delta], first: Delta) -> tuple[str, Delta]:
    """Gives the whole text and the last delta (with the finish reason and the token count)."""
    parts, last = [first.text], first
    async for delta in deltas:
        parts.append(delta.text)
        last = delta
    return "".join(parts), last


def stream(deltas: AsyncIterator[Delta], first: Delta, body: SamplingRequest, prompt_tokens: int, *,
           opening: dict[str, Any] | None, make: Callable[[Delta], dict[str, Any]],
           usage_chunk: Callable[[dict[str, int]], dict[str, Any]]) -> StreamingResponse:
    """Gives the server-sent events of a generation whose first delta has arrived."""
    include_usage = body.include_usage()

    def event(payload: dict[str, Any]) -> str:
        if include_usage and "usage" not in payload:
            payload = {**payload, "usage": None}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        last = first
        try:
            if opening is not None:
                yield event(opening)
            yield event(make(first))
            async for delta in deltas:
                last = delta
                yield event(make(delta))
            if include_usage:
                yield event(usage_chunk(usage(prompt_tokens, last.tokens)))
            yield "data: [DONE]\n\n"
        except ApiError as error:
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            await deltas.aclose()  # a client that left ends the generation here

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
