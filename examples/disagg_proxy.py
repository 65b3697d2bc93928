"""A proxy for prefill/decode disaggregation: each OpenAI completions or chat request goes
to the prefill instance with ``max_tokens=1`` (which computes the prompt and saves its KV
blocks), then, whole, to the decode instance (which loads those blocks instead of
computing the prompt); the answer is the decode instance's, streamed when asked.

    pagedllm serve MODEL --port 8100 --kv-transfer-config \\
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    pagedllm serve MODEL --port 8200 --kv-transfer-config \\
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    python examples/disagg_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# (generous: a long prompt on a slow machine)
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed."""
    body = dict(body, max_tokens=1, stream=False)
    for key in ("max_completion_tokens", "stream_options", "min_tokens"):
        body.pop(key, None)
    return body


def make_app(prefill_url: str, decode_url: str) -> FastAPI:
    clients: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["prefill"] = httpx.AsyncClient(base_url=prefill_url, timeout=TIMEOUT)
        clients["decode"] = httpx.AsyncClient(base_url=decode_url, timeout=TIMEOUT)
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(lifespan=lifespan)

    def passed_headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def disaggregated(request: Request, path: str) -> Response:
        body = await request.json()
        headers = passed_headers(request)
        prefilled = await clients["prefill"].post(path, json=prefill_body(body), headers=headers)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        decode = clients["decode"]
        if not body.get("stream"):
            answer = await decode.post(path, json=body, headers=headers)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = await decode.send(
            decode.build_request("POST", path, json=body, headers=headers), stream=True
        )
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await disaggregated(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await disaggregated(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        answer = await clients["decode"].get("/v1/models", headers=passed_headers(request))
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for name, client in clients.items():
            try:
                if (await client.get("/health")).status_code != 200:
                    raise httpx.HTTPError("unhealthy")
            except httpx.HTTPError:
                return JSONResponse({"unhealthy": name}, status_code=503)
        return Response(status_code=200)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill instance's URL")
    parser.add_argument("--decode", required=True, help="the decode instance's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(make_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
