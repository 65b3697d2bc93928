"""The OpenAI batch format, run in-process through :class:`OpenAIServing`.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` in the
order of the input. A line that cannot be served (invalid JSON, unknown url, invalid body,
a request the engine refuses) gets a response with its HTTP status and an OpenAI error
body, and a non-null ``error``; the batch goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    as_openai_error,
    error_body,
    format_validation_errors,
)
from pagedllm.entrypoints.openai.ignored_fields import warn_ignored
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    random_id,
)
from pagedllm.entrypoints.openai.serving_pooling import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("pagedllm.run_batch")


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    request_type: type[BaseModel]
    handler: str  # the OpenAIServing method (a dotted path: pooling.embeddings)
    id_prefix: str


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, "create_chat_completion", "chatcmpl"),
    "/v1/completions": Endpoint(CompletionRequest, "create_completion", "cmpl"),
    "/v1/embeddings": Endpoint(EmbeddingRequest, "pooling.embeddings", "embd"),
    "/v1/score": Endpoint(ScoreRequest, "pooling.score", "score"),
    "/v1/rerank": Endpoint(RerankRequest, "pooling.rerank", "rerank"),
}
_LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclasses.dataclass(slots=True)
class BatchLine:
    """One parsed input line: a request to run, or the error that stops it."""

    custom_id: str | None
    endpoint: Endpoint | None = None
    request: Any = None
    error: OpenAIError | None = None


def parse_line(text: str, line_number: int) -> BatchLine:
    """Validate one line; problems become ``BatchLine.error`` (never raise)."""
    where = f"line {line_number}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(None, error=OpenAIError(400, f"{where}: invalid JSON ({exc})"))
    if not isinstance(data, dict):
        return BatchLine(None, error=OpenAIError(400, f"{where}: must be a JSON object"))
    custom_id = data.get("custom_id")
    line = BatchLine(custom_id if isinstance(custom_id, str) else None)
    problem = _check_envelope(data)
    if problem is not None:
        line.error = OpenAIError(400, f"{where}: {problem}", param=problem.split(":")[0])
        return line
    line.endpoint = ENDPOINTS[data["url"]]
    try:
        line.request = line.endpoint.request_type.model_validate(data["body"])
    except ValidationError as exc:
        problems = format_validation_errors(exc.errors(), root="body")
        line.error = OpenAIError(
            400, f"{where}: {problems or 'body: invalid request body'}", param="body"
        )
        return line
    warn_ignored(line.request, logger)
    if getattr(line.request, "stream", False):
        line.error = OpenAIError(
            400, f"{where}: body.stream: streaming is not supported in a batch", param="stream"
        )
    return line


def _check_envelope(data: dict[str, Any]) -> str | None:
    unknown = sorted(set(data) - _LINE_KEYS)
    if unknown:
        return f"{', '.join(unknown)}: unknown field (a line has {', '.join(sorted(_LINE_KEYS))})"
    if not isinstance(data.get("custom_id"), str):
        return "custom_id: a string is required"
    if data.get("method", "POST") != "POST":
        return f"method: {data['method']!r} is not supported; use 'POST'"
    url = data.get("url")
    if url not in ENDPOINTS:
        return f"url: {url!r} is not supported; use one of {', '.join(ENDPOINTS)}"
    if not isinstance(data.get("body"), dict):
        return "body: a JSON object is required"
    return None


def make_record(
    custom_id: str | None, request_id: str, status: int, body: dict[str, Any]
) -> dict[str, Any]:
    error = None
    if status != 200:
        details = body.get("error", {})
        error = {"code": details.get("type"), "message": details.get("message")}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def error_record(line: BatchLine, exc: OpenAIError, request_id: str | None = None) -> dict:
    body = error_body(exc.status, exc.message, exc.type, exc.param)
    return make_record(line.custom_id, request_id or random_id("batch"), exc.status, body)


async def run_line(line: BatchLine, serving: OpenAIServing) -> dict[str, Any]:
    """The output record of one line."""
    if line.error is not None:
        return error_record(line, line.error)
    assert line.endpoint is not None
    request_id = line.request.request_id or random_id(line.endpoint.id_prefix)
    handler: Any = serving
    for name in line.endpoint.handler.split("."):
        handler = getattr(handler, name)
    try:
        result = await handler(line.request, request_id)
    except Exception as exc:
        error = as_openai_error(exc)
        if error is None:  # a bug must not sink the whole batch
            logger.exception("request %s failed", request_id)
            error = OpenAIError(500, f"internal error: {exc}")
        return error_record(line, error, request_id)
    return make_record(line.custom_id, request_id, 200, result)


async def run_batch(
    lines: list[BatchLine],
    serving: OpenAIServing,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every line concurrently (so they batch in the engine); records in input order."""

    async def one(line: BatchLine) -> dict[str, Any]:
        record = await run_line(line, serving)
        if on_done is not None:
            on_done(record)
        return record

    return list(await asyncio.gather(*(one(line) for line in lines)))
