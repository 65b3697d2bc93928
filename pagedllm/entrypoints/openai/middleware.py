"""The server's ASGI middleware: body size limit, OpenAI-style 500s, CORS, ``--api-key``,
request ids, ``--enable-server-load-tracking`` and the user's ``--middleware``."""

from __future__ import annotations

import hmac
import importlib
import inspect
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.routing import Match

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.protocol import check_request_id

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

logger = logging.getLogger("pagedllm.server")

ENV_API_KEY = "PAGEDLLM_API_KEY"
# Bodies larger than this are refused before they are read (413).
MAX_BODY_BYTES = 32 * 2**20
# Routes that stay open with --api-key, as in vLLM (matched exactly).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


def api_key(options: FrontendArgs) -> str | None:
    """``--api-key``, else the ``PAGEDLLM_API_KEY`` environment variable."""
    return options.api_key or os.environ.get(ENV_API_KEY)


def add_middleware(app: FastAPI, options: FrontendArgs) -> None:
    """All of the server's middleware, outermost last: the body limit, CORS, the 500s,
    the user's middleware, then authentication and request tagging."""
    key = api_key(options)

    @app.middleware("http")
    async def authenticate_and_tag(request: Request, call_next: Any) -> Response:
        path = request.url.path.removeprefix(options.root_path or "")
        # A path no route serves is a 404 with or without a key.
        if key and request.method != "OPTIONS" and _needs_key(app, path, request.scope):
            supplied = request.headers.get("authorization", "")
            expected = f"Bearer {key}"
            if not hmac.compare_digest(supplied.encode(), expected.encode()):
                return error_response(
                    401, "Unauthorized: a valid API key is required", "AuthenticationError"
                )
        try:
            check_request_id(request.headers.get("x-request-id"), "the X-Request-Id header")
        except ValueError as exc:
            return error_response(400, str(exc), param="X-Request-Id")
        # Always, as vLLM now does (--enable-request-id-headers is kept, a no-op).
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        if options.enable_server_load_tracking:
            app.state.server_load += 1
        try:
            response = await call_next(request)
        finally:
            if options.enable_server_load_tracking:
                app.state.server_load -= 1
        response.headers["X-Request-Id"] = request_id
        return response

    for path in options.middleware:
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
        allow_origins=_json_or_plain_list("--allowed-origins", options.allowed_origins),
        allow_credentials=options.allow_credentials,
        allow_methods=_json_or_plain_list("--allowed-methods", options.allowed_methods),
        allow_headers=_json_or_plain_list("--allowed-headers", options.allowed_headers),
    )
    app.add_middleware(BodySizeLimit)


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
    if path in OPEN_PATHS:
        return False
    return any(route.matches(scope)[0] != Match.NONE for route in app.router.routes)


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than {limit} bytes")


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
