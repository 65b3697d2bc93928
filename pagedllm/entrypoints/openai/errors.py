"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.core.errors import (
    EngineDeadError,
    EngineSleepingError,
    InvalidRequestError,
    RequestFailedError,
)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "BadRequestError")
        self.param = param


def as_openai_error(exc: BaseException) -> OpenAIError | None:
    """The OpenAI error a request's failure is answered with (None: an unexpected one).
    The engine's :class:`InvalidRequestError` keeps its ``param``; any other
    ``ValueError`` is a 400 as well."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, exc.message, param=exc.param)
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc))
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, str(exc))
    if isinstance(exc, (EngineDeadError, EngineSleepingError)):
        return OpenAIError(503, str(exc))
    return None


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int,
    message: str,
    type: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, type, param), status_code=status, headers=headers
    )


def add_exception_handlers(app: FastAPI) -> None:
    """Every error the app raises is answered with an OpenAI error body."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, format_validation_errors(exc.errors()) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def request_error(_: Request, exc: Exception) -> JSONResponse:
        error = as_openai_error(exc)
        assert error is not None
        return error_response(error.status, error.message, error.type, error.param)

    for kind in (OpenAIError, ValueError, RequestFailedError, EngineDeadError, EngineSleepingError):
        app.add_exception_handler(kind, request_error)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # Errors outside the InternalErrors middleware still get a JSON body.
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")


async def stream_errors(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after a stream started become an error event (the status is already
    sent)."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        error = as_openai_error(exc)
        if error is None:
            raise
        body = {"message": error.message, "code": error.status}
        yield "data: " + json.dumps({"error": body}) + "\n\n"
        yield "data: [DONE]\n\n"


def format_validation_errors(errors: Iterable[Mapping[str, Any]], root: str | None = None) -> str:
    """One line naming each invalid field (the 400 message of the server and of
    run-batch). Locations start at ``root`` when given (run-batch says ``body.x``)."""
    problems = []
    for error in errors:
        path = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        message = error.get("msg", "invalid")
        kind = error.get("type")
        if kind == "extra_forbidden":
            message = "unknown field (not part of this API)"
        elif kind == "value_error":
            message = message.removeprefix("Value error, ")
        if kind == "json_invalid":
            where, message = "body", f"invalid JSON ({message})"
        elif root:
            where = f"{root}.{path}" if path else root
        else:
            where = path
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error the server answers (as the OpenAI API)."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: the message names the field and what is wrong with it",
    401: "Missing or wrong API key",
    404: "No such model (or route)",
    413: "The request body is too large",
    500: "The engine failed on this request",
    503: "The engine is not running",
}


def document_errors(schema: dict[str, Any], needs_key: Any) -> None:
    """Make the OpenAPI ``schema`` say what the server really answers on errors: the
    OpenAI error body with 400 (FastAPI documents its own 422, which it never sends
    here), 401 where ``needs_key(path)``, 404/503 on the model routes, 413 for bodies
    and 500 everywhere."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    definitions = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(definitions.pop("$defs", {}))
    components["ErrorResponse"] = definitions
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = {500}
            if "requestBody" in operation:
                statuses |= {400, 413}
            if path.startswith(("/v1/", "/tokenize", "/detokenize", "/invocations")):
                statuses |= {404, 503}
            if path in ("/health", "/ping"):
                statuses.add(503)
            if path == "/load":
                statuses.add(404)
            if needs_key(path):
                statuses.add(401)
            for status in sorted(statuses):
                responses.setdefault(
                    str(status),
                    {
                        "description": _DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": ref}},
                    },
                )
