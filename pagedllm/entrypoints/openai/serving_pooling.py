"""The pooling endpoints, as vLLM serves them: ``/v1/embeddings`` (OpenAI's),
``/pooling``, ``/classify``, ``/score`` (``/v1/score``) and ``/rerank`` (``/v1/rerank``,
``/v2/rerank``: Jina's and Cohere's shape).

Each turns its body into pooling requests (:class:`~pagedllm.core.pooling.PoolingParams`)
queued together on the engine, and the pooled tensors into the response. An engine that
serves another task refuses them with a 400 naming the task it serves."""

from __future__ import annotations

import base64
import struct
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator

from pagedllm.core.pooling import PoolingParams
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.prompts import PreparedPrompt
from pagedllm.entrypoints.openai.protocol import OpenAIModel, now

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving import OpenAIServing

Inputs = str | list[str] | list[int] | list[list[int]]


def _non_empty(value: Any) -> Any:
    if isinstance(value, list) and not value:
        raise ValueError("input must not be empty")
    return value


class _PoolingBody(OpenAIModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = True
    request_id: str | None = None
    priority: int = 0


class EmbeddingRequest(_PoolingBody):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None

    _check_input = field_validator("input")(_non_empty)


class PoolingRequest(_PoolingBody):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"

    _check_input = field_validator("input")(_non_empty)


class ClassificationRequest(_PoolingBody):
    input: Inputs
    activation: bool | None = None

    _check_input = field_validator("input")(_non_empty)


class ScoreRequest(_PoolingBody):
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None

    _check_texts = field_validator("text_1", "text_2")(_non_empty)


class RerankRequest(_PoolingBody):
    query: str
    documents: list[str] = Field(..., min_length=1)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    activation: bool | None = None


def _encode_floats(values: list[float], encoding: str) -> list[float] | str:
    """``base64``: the little-endian float32 bytes, as OpenAI's API sends them."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def _usage(prompts: list[PreparedPrompt]) -> dict[str, int]:
    tokens = sum(len(p.token_ids) for p in prompts)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


class PoolingServing:
    """The pooling handlers of one server."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    # ----------------------------------------------------------------- common

    def _check(self, body: _PoolingBody, task: str, endpoint: str) -> None:
        self.serving.check_model(body.model)
        engine = self.engine.engine
        if task not in engine.served_tasks:
            serves = ", ".join(engine.served_tasks) or engine.task
            raise OpenAIError(
                400,
                f"{endpoint} needs a model served for {task}; this server runs --task "
                f"{engine.task} ({serves})",
            )

    async def _prompts(self, body: _PoolingBody, inputs: Inputs) -> list[PreparedPrompt]:
        request = SimpleNamespace(
            prompt=inputs,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            add_special_tokens=body.add_special_tokens,
        )
        prompts = await self.serving.prompts.run(self.serving.prompts.completion_prompts, request)
        for prompt in prompts:
            if len(prompt.token_ids) > self.serving.max_model_len:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {self.serving.max_model_len} "
                    f"tokens. However, your request has {len(prompt.token_ids)} input tokens. "
                    "Please reduce the length of the input.",
                    param="input",
                )
        return prompts

    async def _run(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        params: list[PoolingParams],
        priority: int,
    ) -> list[Any]:
        """The pooled result of every prompt, in order (queued together: one invalid
        prompt queues none)."""
        results: list[Any] = [None] * len(prompts)
        async for index, output in self.serving.generate_all(request_id, prompts, params, priority):
            if output.finished:
                results[index] = output.outputs.data
        return results

    def _reply(self, request_id: str, data: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "list",
            "created": now(),
            "model": self.serving.model_name,
            "data": data,
            "usage": usage,
        }

    # --------------------------------------------------------------- handlers

    async def embeddings(self, body: EmbeddingRequest, request_id: str) -> dict[str, Any]:
        self._check(body, "embed", "/v1/embeddings")
        prompts = await self._prompts(body, body.input)
        params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalize)
        results = await self._run(request_id, prompts, [params] * len(prompts), body.priority)
        data = [
            {
                "index": i,
                "object": "embedding",
                "embedding": _encode_floats(vector.reshape(-1).tolist(), body.encoding_format),
            }
            for i, vector in enumerate(results)
        ]
        return self._reply(request_id, data, _usage(prompts))

    async def pooling(self, body: PoolingRequest, request_id: str) -> dict[str, Any]:
        engine = self.engine.engine
        task = engine.task if engine.task in engine.served_tasks else "embed"
        self._check(body, task, "/pooling")
        prompts = await self._prompts(body, body.input)
        params = [PoolingParams(task=task)] * len(prompts)
        results = await self._run(request_id, prompts, params, body.priority)
        data = []
        for i, tensor in enumerate(results):
            values = tensor.tolist()
            if body.encoding_format == "base64":
                values = _encode_floats(tensor.reshape(-1).tolist(), "base64")
            data.append({"index": i, "object": "pooling", "data": values})
        return self._reply(request_id, data, _usage(prompts))

    async def classify(self, body: ClassificationRequest, request_id: str) -> dict[str, Any]:
        self._check(body, "classify", "/classify")
        prompts = await self._prompts(body, body.input)
        params = [PoolingParams(task="classify", activation=body.activation)] * len(prompts)
        results = await self._run(request_id, prompts, params, body.priority)
        labels = getattr(self.engine.engine.loaded.hf_config, "id2label", None) or {}
        data = []
        for i, tensor in enumerate(results):
            probs = tensor.reshape(-1).tolist()
            best = int(torch.tensor(probs).argmax())
            data.append(
                {
                    "index": i,
                    "label": labels.get(best, labels.get(str(best), str(best))),
                    "probs": probs,
                    "num_classes": len(probs),
                }
            )
        return self._reply(request_id, data, _usage(prompts))

    async def _scores(
        self, body: _PoolingBody, firsts: list[str], seconds: list[str], request_id: str
    ) -> tuple[list[float], list[PreparedPrompt]]:
        """A score per pair: a cross-encoder's (pairs as one prompt each, with their token
        types), or the cosine similarity of the two texts' embeddings."""
        engine = self.engine.engine
        activation = getattr(body, "activation", None)
        if "score" in engine.served_tasks:
            tokenizer = self.serving.tokenizer
            if tokenizer is None:
                raise OpenAIError(400, "scoring text needs the tokenizer (--skip-tokenizer-init)")

            def encode_pairs() -> list[tuple[PreparedPrompt, list[int] | None]]:
                pairs = []
                for first, second in zip(firsts, seconds, strict=True):
                    encoded = tokenizer(first, text_pair=second)
                    ids = list(encoded["input_ids"])
                    keep = body.truncate_prompt_tokens
                    types = encoded.get("token_type_ids")
                    types = list(types) if types else None
                    if keep:
                        ids, types = ids[-keep:], (types[-keep:] if types else None)
                    pairs.append((PreparedPrompt(f"{first}\n{second}", ids), types))
                return pairs

            for text in (*firsts, *seconds):
                self.serving.prompts.check_text_size(len(text), "text")
            pairs = await self.serving.prompts.run(encode_pairs)
            prompts = [p for p, _ in pairs]
            params = [
                PoolingParams(task="score", activation=activation, token_type_ids=types)
                for _, types in pairs
            ]
            results = await self._run(request_id, prompts, params, body.priority)
            return [float(t.reshape(-1)[0]) for t in results], prompts
        self._check(body, "embed", "scoring")
        unique = list(dict.fromkeys([*firsts, *seconds]))
        prompts = await self._prompts(body, unique)
        params = [PoolingParams(task="embed")] * len(prompts)
        vectors = dict(
            zip(unique, await self._run(request_id, prompts, params, body.priority), strict=True)
        )
        scores = [
            float(
                torch.nn.functional.cosine_similarity(
                    vectors[a].reshape(-1), vectors[b].reshape(-1), dim=0
                )
            )
            for a, b in zip(firsts, seconds, strict=True)
        ]
        return scores, prompts

    async def score(self, body: ScoreRequest, request_id: str) -> dict[str, Any]:
        self.serving.check_model(body.model)
        firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
        seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise OpenAIError(
                400,
                f"text_1 ({len(firsts)} texts) and text_2 ({len(seconds)}) pair one text with "
                "every other, or lists of equal length",
                param="text_2",
            )
        scores, prompts = await self._scores(body, firsts, seconds, request_id)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._reply(request_id, data, _usage(prompts))

    async def rerank(self, body: RerankRequest, request_id: str) -> dict[str, Any]:
        self.serving.check_model(body.model)
        documents = body.documents
        scores, prompts = await self._scores(
            body, [body.query] * len(documents), documents, request_id
        )
        order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        tokens = sum(len(p.token_ids) for p in prompts)
        return {
            "id": request_id,
            "model": self.serving.model_name,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
