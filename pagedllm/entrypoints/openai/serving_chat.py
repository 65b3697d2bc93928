"""``/v1/chat/completions``: one generator of per-choice deltas (content, reasoning, tool
calls; see :mod:`.chat_deltas`), sent as a stream of chunks or added up into the full
response."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.core.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.openai.chat_deltas import ChoiceDeltas, MessageBuilder
from pagedllm.entrypoints.openai.legacy_functions import as_function_call
from pagedllm.entrypoints.openai.logprobs import prompt_logprobs_json
from pagedllm.entrypoints.openai.prompts import PreparedPrompt
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, now
from pagedllm.entrypoints.openai.response_size import ResponseShape
from pagedllm.entrypoints.openai.responses import Outputs, sse_stream
from pagedllm.entrypoints.openai.tool_choice import ToolCallPlan, plan_tool_calls

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving import OpenAIServing


async def create_chat_completion(
    serving: OpenAIServing, request: ChatCompletionRequest, request_id: str
) -> dict[str, Any] | AsyncIterator[str]:
    reply, generator = await start_chat(serving, request, request_id)
    if request.stream:
        return reply.stream(generator)
    return await reply.full(generator)


async def start_chat(
    serving: OpenAIServing, request: ChatCompletionRequest, request_id: str
) -> tuple[ChatReply, Outputs]:
    """The chat request checked, its prompt rendered and its generation started: the
    reply to build and the engine's outputs to build it from (also the Responses API's
    way in)."""
    serving.check_model(request.model)
    serving.check_sequences(1, request)
    images = await serving.chat_images(request.messages)
    prompt = await serving.prompts.run(serving.prompts.chat_prompt, request)
    if images or request.mm_processor_kwargs:
        prompt = dataclasses.replace(
            prompt, images=images, mm_processor_kwargs=request.mm_processor_kwargs
        )
    requested = request.max_completion_tokens
    if requested is None:
        requested = request.max_tokens
    top = request.top_logprobs or 0
    params = request.sampling_params(
        serving.max_tokens(requested, prompt),
        top if request.logprobs else None,
        serving.sampling_defaults,
    )
    tools = plan_tool_calls(
        request,
        params,
        serving.tool_parser,
        serving.options.enable_auto_tool_choice,
        serving.tokenizer,
    )
    as_ids = serving.as_ids(request)
    shape = ResponseShape(
        (lambda ids, positions: serving.logprobs.chat(ids, positions, top, as_ids))
        if request.logprobs
        else None,
        top,
        prompt_copies=1 if request.prompt_logprobs else 0,
    )
    bounded = serving.response_limit.watch([len(prompt.token_ids)], [params], shape)
    generator = bounded(
        serving.generate_all(request_id, [prompt], [params], request.priority, request.model)
    )
    return ChatReply(serving, tools.request, request_id, prompt, tools), generator


class ChatReply:
    """The response to one chat request, built from the engine's outputs."""

    def __init__(
        self,
        serving: OpenAIServing,
        request: ChatCompletionRequest,
        request_id: str,
        prompt: PreparedPrompt,
        tools: ToolCallPlan,
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.prompt = prompt
        self.tools = tools
        self.created = now()
        self.usage = serving.new_usage([prompt])
        self.role = _role(request, serving.options.response_role)
        self.echo_text = ""
        if request.echo and request.messages[-1].get("role") == self.role:
            content = request.messages[-1].get("content")
            self.echo_text = content if isinstance(content, str) else ""
        self._choices: dict[int, ChoiceDeltas] = {}
        self.final: RequestOutput | None = None

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
        }

    def _new_choice(self, index: int) -> ChoiceDeltas:
        reasoning_cls = self.serving.reasoning_parser
        reasoning = None
        if reasoning_cls is not None:
            # Told whether the chat template already opened the reasoning in the prompt.
            reasoning = reasoning_cls.for_prompt(self.serving.tokenizer, self.prompt.text)
        tools = None
        if self.tools.for_choice is not None:
            tools = self.tools.for_choice(index)
        return ChoiceDeltas(self.request, reasoning, tools)

    async def chunks(self, generator: Outputs, whole: bool) -> AsyncIterator[dict[str, Any]]:
        """Each choice's deltas as chunk choices: first its role (and the echo), then
        what each output adds. ``whole``: each output is a complete one, whose chunks
        (megabytes, with log probabilities) are made on a worker thread."""
        async for _, output in generator:
            if whole:
                choices = await asyncio.to_thread(self._output_chunks, output, whole)
            else:
                choices = self._output_chunks(output, whole)
            for choice in choices:
                yield choice

    def _output_chunks(self, output: RequestOutput, whole: bool) -> list[dict[str, Any]]:
        self.final = output
        self.usage.add_output(0, output)
        chunks = []
        for completion in output.outputs:
            self.usage.add_completion_tokens(len(completion.token_ids))
            index = completion.index
            if index not in self._choices:
                self._choices[index] = self._new_choice(index)
                first = {"role": self.role, "content": self.echo_text}
                chunks.append(
                    {"index": index, "delta": first, "logprobs": None, "finish_reason": None}
                )
            if not (completion.text or completion.token_ids or completion.finish_reason):
                continue
            delta, finish_reason = self._choices[index].step(
                completion.text, completion.token_ids, completion.finish_reason, whole
            )
            if "reasoning_content" in delta:
                # vLLM's newer name beside the older one it still sends.
                delta["reasoning"] = delta["reasoning_content"]
            if self.request.legacy_functions:
                delta, finish_reason = as_function_call(delta, finish_reason)
            chunks.append(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._logprobs(completion),
                    "finish_reason": finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        return chunks

    def _logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        request = self.request
        if not request.logprobs:
            return None
        return self.serving.logprobs.chat(
            completion.token_ids,
            completion.logprobs or [],
            request.top_logprobs or 0,
            self.serving.as_ids(request),
        )

    def stream(self, generator: Outputs) -> AsyncIterator[str]:
        return sse_stream(
            self.chunks(generator, whole=False),
            lambda choices: self._envelope("chat.completion.chunk", choices),
            self.usage,
            self.request.stream_options,
        )

    async def full(self, generator: Outputs) -> dict[str, Any]:
        builders: dict[int, MessageBuilder] = {}
        with_reasoning = self.serving.reasoning_parser is not None
        async for choice in self.chunks(generator, whole=True):
            index = choice["index"]
            if index not in builders:
                builders[index] = MessageBuilder(index, with_reasoning)
            builders[index].add(choice)
        assert self.final is not None
        response = self._envelope(
            "chat.completion", [builders[index].choice() for index in sorted(builders)]
        )
        response["usage"] = self.usage.json()
        if self.request.prompt_logprobs:
            response["prompt_logprobs"] = await asyncio.to_thread(prompt_logprobs_json, self.final)
        return response


def _role(request: ChatCompletionRequest, response_role: str) -> str:
    if request.add_generation_prompt:
        return response_role
    return request.messages[-1].get("role", response_role)
