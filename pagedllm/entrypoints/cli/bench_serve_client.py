"""HTTP side of ``pagedllm bench serve``: one streamed request, timed like vLLM's
benchmark_serving (TTFT, inter-token latencies, end-to-end latency), and the server's
model list and (de)tokenizer endpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

CHAT_ENDPOINT = "/v1/chat/completions"


class BenchError(Exception):
    """A problem that stops the benchmark (one line on stderr, exit code 1)."""


@dataclasses.dataclass(slots=True)
class RequestInput:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclasses.dataclass(slots=True)
class RequestResult:
    prompt_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_payload(
    endpoint: str, model: str, request: RequestInput, ignore_eos: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT_ENDPOINT:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Send one streamed request; each server-sent chunk with text is a token event."""
    import httpx

    result = RequestResult(prompt_len=prompt_len)
    texts: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=auth_headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data_text = line.removeprefix("data:").strip()
                if data_text == "[DONE]":
                    continue
                data = json.loads(data_text)
                if "error" in data:
                    result.error = str(data["error"].get("message", data["error"]))
                    return result
                now = time.perf_counter()
                text = "".join(_chunk_text(c) for c in data.get("choices") or [])
                if text:
                    if not texts:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    texts.append(text)
                usage = data.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_len = usage.get("prompt_tokens") or prompt_len
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.generated_text = "".join(texts)
    if not texts:
        result.error = "Never received a valid chunk to calculate TTFT."
        return result
    result.latency = last - start
    if result.output_tokens is None:
        result.output_tokens = len(texts)
    result.success = True
    return result


class ServerInfo:
    """What the benchmark asks the server before it starts."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(timeout=60, headers=auth_headers())

    def get(self, path: str) -> Any:
        import httpx

        try:
            response = self.client.get(self.base_url + path)
        except httpx.HTTPError as exc:
            raise BenchError(
                f"cannot connect to the server at {self.base_url} ({exc}); is it running?"
            ) from exc
        if response.status_code != 200:
            raise BenchError(f"GET {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    def post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        import httpx

        try:
            return self.client.post(self.base_url + path, json=payload)
        except httpx.HTTPError as exc:
            raise BenchError(f"POST {path}: {exc}") from exc

    def first_model(self) -> dict[str, Any]:
        models = self.get("/v1/models").get("data") or []
        if not models:
            raise BenchError("the server lists no models; pass --model")
        return models[0]

    def close(self) -> None:
        self.client.close()
