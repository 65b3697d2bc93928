"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

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
