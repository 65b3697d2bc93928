"""The OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import hmac
import importlib
import inspect
import json
import logging
import os
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pagedllm import __version__
from pagedllm.core.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    document_errors,
    error_response,
    format_validation_errors,
)
from pagedllm.entrypoints.openai.metrics import Metrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_request_id,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.openai.serving_setup import RequestLog

logger = logging.getLogger("pagedllm.server")

ENV_API_KEY = "PAGEDLLM_API_KEY"
# Bodies larger than this are refused before they are read (413).
MAX_BODY_BYTES = 32 * 2**20
# Routes that stay open with --api-key, as in vLLM (matched exactly).
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes (declared or streamed)."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(self.limit)(scope, receive, send)
            return
        if declared is not None:
            # The server reads no more than the declared length.
            await self.app(scope, receive, send)
            return
        # A chunked body is read here, up to the limit, and replayed to the app: an error
        # raised from inside the app's receive() would reach FastAPI wrapped in an
        # ExceptionGroup (by the http middleware's task group) and become a 400.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.limit:
                await _too_large(self.limit)(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if message["type"] != "http.request":
            pending = [message]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes an OpenAI-style 500.

    Starlette's own handler re-raises after answering, and uvicorn then closes the
    connection, so a client's next request on that keep-alive connection would fail too.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # too late for a clean answer: let the server drop the connection
                raise
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
            await response(scope, receive, send)


def _needs_key(app: FastAPI, path: str, scope: dict[str, Any]) -> bool:
    """Whether ``path`` is a route of ``app`` that --api-key protects."""
    if path in _OPEN_PATHS:
        return False
    return any(route.matches(scope)[0] != Match.NONE for route in app.router.routes)


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than {limit} bytes")


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled,
    which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)


def _json_or_plain_list(flag: str, values: list[str]) -> list[str]:
    """``--allowed-origins`` and friends: vLLM takes one JSON list
    (``'["https://a.example"]'``); plain values (``https://a.example``) work too."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{flag} {value!r} is not a valid JSON list: {exc}") from exc
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise ConfigError(f"{flag} {value!r} must be a JSON list of strings")
            out.extend(parsed)
        else:
            out.append(value)
    return out


def _import_middleware(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--middleware {path}: cannot import it: {exc}") from exc


def build_app(
    args: FrontendArgs,
    engine: AsyncLLMEngine,
    serving: OpenAIServing,
    metrics: Metrics,
    pm: Any,
    model_path: str,
) -> FastAPI:
    docs = not args.disable_fastapi_docs
    app = FastAPI(
        title="pagedllm OpenAI-compatible API",
        version=__version__,
        root_path=args.root_path or "",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server_load = 0
    api_key = args.api_key or os.environ.get(ENV_API_KEY)

    @app.middleware("http")
    async def authenticate_and_tag(request: Request, call_next: Any) -> Response:
        path = request.url.path.removeprefix(args.root_path or "")
        # A path no route serves is a 404 with or without a key.
        if api_key and request.method != "OPTIONS" and _needs_key(app, path, request.scope):
            supplied = request.headers.get("authorization", "")
            expected = f"Bearer {api_key}"
            if not hmac.compare_digest(supplied.encode(), expected.encode()):
                return error_response(
                    401, "Unauthorized: a valid API key is required", "AuthenticationError"
                )
        try:
            check_request_id(request.headers.get("x-request-id"), "the X-Request-Id header")
        except ValueError as exc:
            return error_response(400, str(exc), param="X-Request-Id")
        request_id = None
        if args.enable_request_id_headers:
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            request.state.request_id = request_id
        if args.enable_server_load_tracking:
            app.state.server_load += 1
        try:
            response = await call_next(request)
        finally:
            if args.enable_server_load_tracking:
                app.state.server_load -= 1
        if request_id is not None:
            response.headers["X-Request-Id"] = request_id
        return response

    for path in args.middleware:
        target = _import_middleware(path)
        if inspect.isclass(target):
            app.add_middleware(target)
        elif inspect.iscoroutinefunction(target):
            app.middleware("http")(target)
        else:
            raise ConfigError(f"--middleware {path}: neither a class nor an async function")

    app.add_middleware(InternalErrors)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=_json_or_plain_list("--allowed-origins", args.allowed_origins),
        allow_credentials=args.allow_credentials,
        allow_methods=_json_or_plain_list("--allowed-methods", args.allowed_methods),
        allow_headers=_json_or_plain_list("--allowed-headers", args.allowed_headers),
    )
    app.add_middleware(BodySizeLimit)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, format_validation_errors(exc.errors()) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(RequestFailedError)
    async def failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # Errors outside InternalErrors (in the outer middleware) still get a JSON body.
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")

    def request_id_for(request: Request, body_id: str | None, prefix: str) -> str:
        # As vLLM: the X-Request-Id header, else the body's request_id, else a random id,
        # always with the endpoint's prefix.
        base = request.headers.get("x-request-id") or body_id
        return f"{prefix}-{base}" if base else random_id(prefix)

    log_request = RequestLog(not args.disable_log_requests, args.max_log_len, logger)

    async def respond(request: Request, result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if inspect.isasyncgen(result):
            # The first chunk is computed before the 200 is sent, so a request the engine
            # refuses still gets its 400.
            first = await anext(result)
            return StreamingResponse(
                _stream_errors(_prepend(first, result)), media_type="text/event-stream"
            )
        return JSONResponse(result)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        if not args.enable_server_load_tracking:
            raise OpenAIError(404, "start the server with --enable-server-load-tracking")
        return {"server_load": app.state.server_load}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.refresh(engine.engine)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "pagedllm",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": serving.max_model_len,
                }
                for name in serving.settings.served_model_names
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id = request_id_for(request, body.request_id, "cmpl")
        log_request(request_id, body)
        work = serving.create_completion(body, request_id)
        return await respond(request, await _until_disconnect(request, work))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = request_id_for(request, body.request_id, "chatcmpl")
        log_request(request_id, body)
        work = serving.create_chat_completion(body, request_id)
        return await respond(request, await _until_disconnect(request, work))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        try:
            payload = await request.json()
        except json.JSONDecodeError as exc:
            raise OpenAIError(400, f"invalid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        try:
            if "messages" in payload:
                return await chat_completions(
                    ChatCompletionRequest.model_validate(payload), request
                )
            if "prompt" in payload:
                return await completions(CompletionRequest.model_validate(payload), request)
        except Exception as exc:
            if hasattr(exc, "errors"):
                raise RequestValidationError(exc.errors()) from exc
            raise
        raise OpenAIError(400, "the body needs 'messages' (chat) or 'prompt' (completions)")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.create_tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.create_detokenize(body)

    pm.hook.pagedllm_add_api_routes(app=app, engine=engine)
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document_errors(
                generate_openapi(),
                lambda path: bool(api_key) and path not in _OPEN_PATHS and path != "/docs",
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _stream_errors(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the stream started become an error event (the status is already
    sent)."""
    try:
        async for chunk in stream:
            yield chunk
    except (OpenAIError, ValueError, RequestFailedError, EngineDeadError) as exc:
        status = getattr(exc, "status", 400 if isinstance(exc, ValueError) else 500)
        message = getattr(exc, "message", str(exc))
        yield "data: " + json.dumps({"error": {"message": message, "code": status}}) + "\n\n"
        yield "data: [DONE]\n\n"


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for chunk in rest:
        yield chunk


def run_server(engine_args: Any, args: FrontendArgs, pm: Any) -> int:
    """Load the model, then serve until SIGINT/SIGTERM."""
    import logging.config

    import uvicorn

    from pagedllm.entrypoints.openai.serving_setup import ServingOptions, build_serving

    log_config = None
    if args.log_config_file:
        try:
            with open(args.log_config_file, encoding="utf-8") as f:
                log_config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--log-config-file {args.log_config_file}: {exc}") from exc
        logging.config.dictConfig(log_config)
    options = ServingOptions(
        response_role=args.response_role,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        max_sequences_per_request=args.max_sequences_per_request,
    )
    stack = build_serving(engine_args, options, pm)
    config, engine = stack.config, stack.engine
    names = stack.model_names
    app = build_app(args, engine, stack.serving, stack.metrics, pm, config.model_config.model)

    @app.on_event("shutdown")
    async def stop_engine() -> None:
        engine.shutdown()

    server_config = uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=10,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # A stop signal also stops the guided-decoding compiles, so that requests
            # waiting on one end at once instead of holding up the shutdown. Not in the
            # handler itself: it may have interrupted a holder of a lock the work needs.
            threading.Thread(target=engine.stop_compiling, name="pagedllm-stop").start()

    server = Server(server_config)

    def exit_when_engine_dies() -> None:
        # A dead engine loop cannot recover: stop serving (and exit non-zero) so that a
        # supervisor restarts the server instead of it answering 503 forever.
        engine.dead.wait()
        logger.critical("the engine loop died; stopping the server")
        server.should_exit = True

    threading.Thread(target=exit_when_engine_dies, name="pagedllm-watchdog", daemon=True).start()
    logger.info(
        "serving %s as %s on %s:%d",
        config.model_config.model,
        ", ".join(names),
        server_config.host,
        args.port,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down, which would kill
    # the process with that signal; a handler of our own receives it instead, so SIGTERM
    # and Ctrl+C end the process normally (exit code 0).
    stopped_by: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda number, _frame: stopped_by.append(number))
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
    if engine.dead.is_set():
        return 1
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)
    return 0
