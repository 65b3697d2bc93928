"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.responses import JSONResponse

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
