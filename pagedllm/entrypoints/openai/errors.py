"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

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
