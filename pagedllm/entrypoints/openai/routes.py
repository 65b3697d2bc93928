"""The server's routes: the OpenAI endpoints, vLLM's extras (``/tokenize``,
``/detokenize``, ``/invocations``) and the operational ones (``/health``, ``/metrics``,
...)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import __version__
from pagedllm.entrypoints.openai.errors import OpenAIError, stream_errors
from pagedllm.entrypoints.openai.ignored_fields import (
    IGNORED_FIELDS_HEADER,
    header_value,
    warn_ignored,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIModel,
    TokenizeRequest,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.tracing import incoming_trace_headers, trace_headers

if TYPE_CHECKING:
    from pagedllm.core.engine_client import EngineClient
    from pagedllm.entrypoints.metrics import Metrics, ReplicaMetrics
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs
    from pagedllm.entrypoints.openai.response_size import ResponseLimit
    from pagedllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("pagedllm.server")


def add_routes(
    app: FastAPI,
    options: FrontendArgs,
    engine: EngineClient,
    serving: OpenAIServing,
    metrics: Metrics | ReplicaMetrics,
    model_path: str,
) -> None:
    limit = serving.response_limit

    async def respond(result: Any) -> Response:
        """A generation's response, its body within --max-response-mb."""
        return await _respond(result, limit)

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
        if not options.enable_server_load_tracking:
            raise OpenAIError(404, "start the server with --enable-server-load-tracking")
        return {"server_load": app.state.server_load}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await metrics.exposition(engine), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, bool]:
        """vLLM's: forget every cached prefix (``{"success": false}`` while a request
        holds blocks; retry). Its options pagedllm does not honour are refused by name."""
        for name in ("reset_running_requests", "reset_external"):
            if request.query_params.get(name, "false").lower() not in ("false", "0"):
                raise OpenAIError(
                    400,
                    f"{name}: pagedllm resets the prefix cache of finished requests only",
                    param=name,
                )
        reset = getattr(engine, "reset_prefix_cache", None)
        if reset is None:
            raise OpenAIError(
                501,
                "POST /reset_prefix_cache is not supported with --data-parallel-size above 1 "
                "yet",
                type="NotImplementedError",
            )
        return {"success": bool(await reset())}

    def model_cards() -> list[dict[str, Any]]:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "pagedllm",
                "root": model_path,
                "parent": None,
                "max_model_len": serving.max_model_len,
            }
            for name in serving.model_names
        ]
        return cards + [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "pagedllm",
                "root": lora.lora_path,
                "parent": lora.base_model_name or serving.model_name,
                "max_model_len": serving.max_model_len,
            }
            for name, lora in serving.loras.items()
        ]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    # (``:path``: model names such as ``org/name`` hold a slash)
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise OpenAIError(
            404, f"The model `{model_id}` does not exist.", "NotFoundError", param="model"
        )

    if runtime_lora_updating():

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRARequest) -> Response:
            await serving.load_lora(body.lora_name, body.lora_path)
            done = f"Success: LoRA adapter '{body.lora_name}' added successfully."
            return _note_ignored(body, Response(done))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRARequest) -> Response:
            await serving.unload_lora(body.lora_name)
            done = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
            return _note_ignored(body, Response(done))

    async def run(body: Any, request: Request, prefix: str, handler: Any, reply: Any) -> Response:
        """A request's work: its id, the handler's result unless the client disconnects
        first, sent by ``reply``, its ignored fields named."""
        request_id = _request_id(request, body.request_id, prefix)
        if serving.tracer is not None:  # (the span's parent, read where it is submitted)
            incoming_trace_headers.set(trace_headers(request.headers))
        result = await _until_disconnect(request, handler(body, request_id))
        return _note_ignored(body, await reply(result))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await run(body, request, "cmpl", serving.create_completion, respond)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await run(body, request, "chatcmpl", serving.create_chat_completion, respond)

    responses = serving.responses  # (a bad PAGEDLLM_RESPONSES_STORE_MB fails the start)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await run(body, request, "resp", responses.create, respond)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise OpenAIError(
                400, "stream: a stored response cannot be streamed again", param="stream"
            )
        return responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await responses.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await responses.delete(response_id)

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

    pooling = serving.pooling

    def pooled(path_prefix: str, handler: Any, body_cls: type) -> Any:
        async def endpoint(body: Any, request: Request) -> Response:
            return await run(body, request, path_prefix, handler, _respond)

        # (FastAPI reads the body's model from the annotation)
        endpoint.__annotations__ = {"body": body_cls, "request": Request, "return": Response}
        return endpoint

    app.post("/v1/embeddings")(pooled("embd", pooling.embeddings, EmbeddingRequest))
    app.post("/pooling")(pooled("pool", pooling.pooling, PoolingRequest))
    app.post("/classify")(pooled("classify", pooling.classify, ClassificationRequest))
    for path in ("/score", "/v1/score"):
        app.post(path)(pooled("score", pooling.score, ScoreRequest))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(pooled("rerank", pooling.rerank, RerankRequest))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return _note_ignored(body, JSONResponse(await serving.create_tokenize(body)))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _note_ignored(body, JSONResponse(await serving.create_detokenize(body)))


class LoadLoRARequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None


def runtime_lora_updating() -> bool:
    """``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's name) is true: the server takes
    adapters at run time."""
    for name in ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        if os.environ.get(name, "").strip().lower() in ("1", "true"):
            return True
    return False


def _request_id(request: Request, body_id: str | None, prefix: str) -> str:
    # As vLLM: the X-Request-Id header, else the body's request_id, else a random id,
    # always with the endpoint's prefix.
    base = request.headers.get("x-request-id") or body_id
    return f"{prefix}-{base}" if base else random_id(prefix)


def _note_ignored(body: OpenAIModel, response: Response) -> Response:
    """Warn of the body's unknown (ignored) fields and name them in the response."""
    ignored = warn_ignored(body, logger)
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = header_value(ignored)
    return response


async def _respond(result: Any, limit: ResponseLimit | None = None) -> Response:
    if isinstance(result, Response):
        return result
    if inspect.isasyncgen(result):
        # The first chunk is computed before the 200 is sent, so a request the engine
        # refuses still gets its 400.
        first = await anext(result)
        return StreamingResponse(
            stream_errors(_prepend(first, result)), media_type="text/event-stream"
        )
    if limit is not None:  # (serialized on a worker thread)
        return await limit.json_response(result)
    return JSONResponse(result)


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


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for chunk in rest:
        yield chunk
