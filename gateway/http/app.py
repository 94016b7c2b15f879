"""The OpenAI-compatible routes (FastAPI) over the gateway core.

Each generation route: check the model name, translate the body (translate.py), admit it through
`Gateway.admit` (the gRPC front's validation, tokenization and in-flight bound), then either one
JSON object or server-sent events (`data: {chunk}` ... `data: [DONE]`). A stream's first chunk is
awaited before the response starts, so anything refused before the first token (bad input,
overload, no replica, a target's refusal) still gets its HTTP status; after that an error is sent
as a `data: {"error": ...}` event. A client that goes away cancels its request on the target at
once, streamed or not.

With tokens (the gateway's --token-file), every request must send `Authorization: Bearer <token>`
(the `api_key` of OpenAI's clients): none is 401, a wrong one 403, checked before the body is read.
Only `/health` stays open, for probes, and `/metrics`, as on the services' own metrics ports
(operational counters, no request content): keep it from the public, or leave metrics off. Denying
by default also covers FastAPI's own `/docs` and `/openapi.json`.

Every request is a server span (`POST /v1/chat/completions`), a child of the caller's W3C
`traceparent` header when it has a valid one; the gateway's `gen_ai.generate` span and the
target's spans hang under it, as they do under a gRPC caller's traceparent.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import samples
from gateway.http import translate
from gateway.http.errors import ApiError, from_exception, from_validation, model_not_found
from gateway.http.schema import ChatCompletionRequest, CompletionRequest
from gateway.service import Gateway
from specstream.data.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from specstream.serving import telemetry
from specstream.serving.auth import TokenSet
from specstream_pb import generation_pb2

T = TypeVar("T")
STARTED = int(time.time())  # /v1/models' "created"


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source (which cancels the request on the
    target), the moment the client disconnects, not at the next event's failed write."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            self.on_close()
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            raise results[0]


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancels it (and raises ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 before the app (and
    pydantic) see it, whether it declares its length or streams in chunks: the HTTP twin of the
    gRPC servers' message-size limit. The body is read here and replayed to the app, whose later
    `receive()` calls (disconnect watching) go to the connection as before."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body arrived
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = ApiError(413, f"the request body is larger than {self.limit} bytes", "invalid_request_error", None,
                         "request_too_large")
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


class BearerAuth:
    """ASGI middleware: every request but those for OPEN paths needs a bearer token `tokens`
    accepts; refusals are OpenAI errors (401 without one, 403 with a wrong one; statuses from
    errors.py)."""

    OPEN = frozenset({"/health", "/metrics"})

    def __init__(self, app, tokens: TokenSet) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in self.OPEN:
            header = dict(scope.get("headers") or []).get(b"authorization")
            try:
                self.tokens.check(header.decode("latin-1") if header is not None else None)
            except (UnauthenticatedError, PermissionDeniedError) as exc:
                error = from_exception(exc)
                return await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(
                    scope, receive, send)
        await self.app(scope, receive, send)


def _json_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def build_app(gateway: Gateway, registry: CollectorRegistry | None = None,
              ready: Callable[[], bool] | None = None, max_body_bytes: int = 64 * 1024 * 1024,
              tokens: TokenSet | None = None) -> FastAPI:
    """The app. `registry`: served on /metrics when given. `ready`: False while the gateway is
    shutting down (health then reads 503 whatever the replicas say). `max_body_bytes`: larger
    request bodies get 413. `tokens`: every path but /health and /metrics needs one (BearerAuth)."""
    # FastAPI releases with their own OpenTelemetry spans would trace each request twice: ours
    # (below) is the one that joins the gateway's and the target's spans, in every release.
    native = {"telemetry": {"tracing": False, "metrics": False, "logs": False}} \
        if "telemetry" in inspect.signature(FastAPI).parameters else {}
    app = FastAPI(title="specstream", summary="OpenAI-compatible API of a speculative-decoding server",
                  version="0.1.0", **native)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if tokens is not None:
        app.add_middleware(BearerAuth, tokens=tokens)  # added last, so it runs first: before the body is read
    tracer = telemetry.tracer("specstream.gateway.http")
    is_ready = ready or (lambda: True)

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def unreadable_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind,
                                       None, None, dict(exc.headers or {})))

    @app.get("/health")
    async def health() -> JSONResponse:
        serving = is_ready() and gateway.serving
        return JSONResponse({"status": "ok" if serving else "not_serving"}, status_code=200 if serving else 503)

    def model_card() -> dict[str, Any]:
        return {"id": gateway.model_name, "object": "model", "created": STARTED, "owned_by": "specstream",
                "max_model_len": gateway.limits.max_context_length}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != gateway.model_name:
            return error_response(model_not_found(model, gateway.model_name))
        return JSONResponse(model_card())

    if registry is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def serve(body: translate.Body, request: Request, encoder_of) -> Response:
        span = tracer.start_span(f"POST {request.url.path}", context=telemetry.context_from(
            request.headers.get("traceparent", "")), kind=telemetry.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": request.url.path, "http.route": request.url.path,
                        "gen_ai.request.model": body.model, "specstream.stream": bool(body.stream)})
        caller = request.headers.get("traceparent", "") if telemetry.context_from(
            request.headers.get("traceparent", "")) else ""
        status, streaming, admitted = 200, False, []

        def param_of(field: str) -> str:
            return translate.param_name(field, body)

        try:
            if not is_ready():  # shutting down: a kept-alive connection gets no new work
                raise UnavailableError("the gateway is shutting down")
            if body.model != gateway.model_name:
                raise model_not_found(body.model, gateway.model_name)
            pb = translate.to_generate_request(body, telemetry.traceparent_of(span) or caller)
            # n > 1: one request a choice, sent together (gateway/samples.py)
            admitted = await gateway.admit_samples(pb, fill_max_new_tokens=translate.fills_max_new_tokens(body),
                                                   authorization=request.headers.get("authorization"))
            encoders = [encoder_of(valid) for valid in admitted]
            if len(encoders) > 1:
                translate.for_choices(encoders)
            if not body.stream:
                responses = await _unless_gone(request, samples.gather([gateway.generate(valid)
                                                                        for valid in admitted]))
                if len(responses) == 1:
                    return JSONResponse(encoders[0].response(responses[0]))
                return JSONResponse(translate.samples_response(encoders, responses))
            streams = [gateway.stream(valid) for valid in admitted]
            try:
                firsts = await _unless_gone(request, samples.gather([chunks.__anext__() for chunks in streams]))
            except BaseException:
                for chunks in streams:
                    await chunks.aclose()
                raise
            streaming = True

            def closed(done=tuple(admitted)) -> None:
                for valid in done:
                    gateway.release(valid)  # also when the response never started its body
                span.end()

            if len(streams) == 1:
                return EventStream(_events(encoders[0], firsts[0], streams[0], param_of), on_close=closed)
            return EventStream(_choice_events(encoders, firsts, streams, param_of, _include_usage(body)),
                               on_close=closed)
        except ClientGone:
            status = 499
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - becomes the OpenAI error the caller gets
            error = from_exception(exc, param_of)
            status = error.status
            return error_response(error)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(telemetry.StatusCode.ERROR, str(status))
            elif status >= 400:
                span.set_attribute("error.type", str(status))
            if not streaming:
                for valid in admitted:  # admitted, then refused, gone or answered whole
                    gateway.release(valid)
                span.end()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        def encoder_of(valid):
            prompt = body.prompt if isinstance(body.prompt, str) else gateway.tokenizer.decode(valid.prompt_ids)
            if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
                prompt = body.prompt[0]
            return translate.CompletionEncoder(body, valid.request_id, gateway.tokenizer, _include_usage(body),
                                               prompt)

        return await serve(body, request, encoder_of)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        def encoder_of(valid):
            return translate.ChatEncoder(body, valid.request_id, gateway.tokenizer, _include_usage(body))

        return await serve(body, request, encoder_of)

    return app


def _include_usage(body: translate.Body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


async def _choice_events(encoders: list, firsts: list[generation_pb2.GenerateStreamResponse],
                         streams: list[AsyncIterator[generation_pb2.GenerateStreamResponse]],
                         param_of: Callable[[str], str], include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a request's ``n`` choices: each choice's chunks (its own index) as they
    come, then with include_usage one usage chunk for them all, then `[DONE]`; an error of any
    choice ends the stream as in ``_events``."""
    last: list[generation_pb2.GenerateStreamResponse | None] = [None] * len(streams)
    try:
        for i, first in enumerate(firsts):
            for out in encoders[i].chunks(first):
                yield _json_event(out)
            last[i] = first if first.finish_reason else None
        async for i, chunk in samples.interleaved(streams):
            for out in encoders[i].chunks(chunk):
                yield _json_event(out)
            if chunk.finish_reason:
                last[i] = chunk
        if include_usage and all(last):
            yield _json_event(encoders[0].usage_tail(last[0], translate.samples_usage([c.usage for c in last])))
    except Exception as exc:  # noqa: BLE001 - the status line is gone: reported in the stream
        yield _json_event(from_exception(exc, param_of).body())
    finally:
        for chunks in streams:
            await chunks.aclose()
    yield "data: [DONE]\n\n"


async def _events(encoder, first: generation_pb2.GenerateStreamResponse,
                  chunks: AsyncIterator[generation_pb2.GenerateStreamResponse],
                  param_of: Callable[[str], str]) -> AsyncIterator[str]:
    """The SSE body: the chunks as OpenAI sends them, then `[DONE]`; an error after the first
    chunk goes out as an `error` event (OpenAI's client raises it), then `[DONE]`."""
    try:
        for out in encoder.chunks(first):
            yield _json_event(out)
        async for chunk in chunks:
            for out in encoder.chunks(chunk):
                yield _json_event(out)
    except Exception as exc:  # noqa: BLE001 - the status line is gone: reported in the stream
        yield _json_event(from_exception(exc, param_of).body())
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"
