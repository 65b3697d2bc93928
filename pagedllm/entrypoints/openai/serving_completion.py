"""``/v1/completions``: one generator of choice deltas, sent as a stream of chunks or
merged into the full response, so both carry the same text, logprobs and offsets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.core.beam_search import BeamSearch, BeamSearchParams
from pagedllm.core.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.openai.logprobs import prompt_logprobs_json
from pagedllm.entrypoints.openai.prompts import PreparedPrompt
from pagedllm.entrypoints.openai.protocol import CompletionRequest, now
from pagedllm.entrypoints.openai.response_size import ResponseShape
from pagedllm.entrypoints.openai.responses import Outputs, sse_stream

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving import OpenAIServing

ChoiceKey = tuple[int, int]  # (prompt index, completion index)


async def create_completion(
    serving: OpenAIServing, request: CompletionRequest, request_id: str
) -> dict[str, Any] | AsyncIterator[str]:
    serving.check_model(request.model)
    serving.check_sequences(_num_prompts(request.prompt), request)
    prompts = await serving.prompts.run(serving.prompts.completion_prompts, request)
    if request.use_beam_search:
        return await beam_search_completion(serving, request, request_id, prompts)
    # echo with max_tokens=0 scores the prompt (as lm-eval does): one token is computed
    # and dropped, as in vLLM.
    max_tokens = 1 if _echo_only(request) else request.max_tokens
    params_list = []
    for prompt in prompts:
        params = request.sampling_params(
            serving.max_tokens(max_tokens, prompt), request.logprobs, serving.sampling_defaults
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = request.logprobs
        params_list.append(params)
    top, as_ids = request.logprobs, serving.as_ids(request)
    shape = ResponseShape(
        (lambda ids, positions: serving.logprobs.completion(ids, positions, top, 0, as_ids))
        if top is not None
        else None,
        top or 0,
        prompt_copies=request.n if request.prompt_logprobs else 0,
        echo_copies=request.n if request.echo else 0,
    )
    bounded = serving.response_limit.watch([len(p.token_ids) for p in prompts], params_list, shape)
    generator = bounded(
        serving.generate_all(request_id, prompts, params_list, request.priority, request.model)
    )
    reply = CompletionReply(serving, request, request_id, prompts)
    if request.stream:
        return reply.stream(generator)
    return await reply.full(generator)


class CompletionReply:
    """The response to one completion request, built from the engine's outputs."""

    def __init__(
        self,
        serving: OpenAIServing,
        request: CompletionRequest,
        request_id: str,
        prompts: list[PreparedPrompt],
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.created = now()
        self.usage = serving.new_usage(prompts)
        self._echoed: set[ChoiceKey] = set()
        # Where each choice's next token starts, so text_offset values continue across
        # chunks as they run in one response.
        self._offsets: dict[ChoiceKey, int] = {}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.serving.model_name,
            "choices": choices,
        }

    async def choices(
        self, generator: Outputs, whole: bool = False
    ) -> AsyncIterator[tuple[ChoiceKey, dict[str, Any]]]:
        """Each output's new part as a choice; the first one of a choice carries the echo.
        ``whole``: each output is a complete one, whose choices (megabytes, with log
        probabilities) are made on a worker thread."""
        async for index, output in generator:
            if whole:
                choices = await asyncio.to_thread(self._output_choices, index, output)
            else:
                choices = self._output_choices(index, output)
            for choice in choices:
                yield choice

    def _output_choices(
        self, index: int, output: RequestOutput
    ) -> list[tuple[ChoiceKey, dict[str, Any]]]:
        request = self.request
        self.usage.add_output(index, output)
        # (the same list in every choice of the prompt)
        prompt_logprobs = prompt_logprobs_json(output) if request.prompt_logprobs else None
        choices = []
        for completion in output.outputs:
            key = (index, completion.index)
            generated = 0 if _echo_only(request) else len(completion.token_ids)
            self.usage.add_completion_tokens(generated)
            echo = request.echo and key not in self._echoed
            self._echoed.add(key)
            offset = self._offsets.get(key, 0)
            choice = self._choice(index, output, completion, echo, offset, prompt_logprobs)
            logprobs = choice["logprobs"]
            if logprobs is not None and logprobs["tokens"]:
                self._offsets[key] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choices.append((key, choice))
        return choices

    def _choice(
        self,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        echo: bool,
        text_offset: int,
        prompt_logprobs: list[Any] | None,
    ) -> dict[str, Any]:
        request = self.request
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs
        if _echo_only(request):
            text, token_ids, positions = "", [], []
        prefix = (self.prompts[prompt_index].text or "") if echo else ""
        logprobs = None
        if request.logprobs is not None:
            ids, pos = list(token_ids), list(positions or [])
            if echo:
                prompt_ids = output.prompt_token_ids
                ids = list(prompt_ids) + ids
                pos = list(output.prompt_logprobs or [None] * len(prompt_ids)) + pos
            logprobs = self.serving.logprobs.completion(
                ids, pos, request.logprobs, text_offset, self.serving.as_ids(request)
            )
        return {
            "index": prompt_index * request.n + completion.index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "prompt_logprobs": prompt_logprobs,
        }

    def stream(self, generator: Outputs) -> AsyncIterator[str]:
        choices = (choice async for _, choice in self.choices(generator))
        return sse_stream(choices, self._envelope, self.usage, self.request.stream_options)

    async def full(self, generator: Outputs) -> dict[str, Any]:
        merged: dict[ChoiceKey, dict[str, Any]] = {}
        async for key, choice in self.choices(generator, whole=True):
            merged[key] = _merge_choice(merged[key], choice) if key in merged else choice
        response = self._envelope([merged[key] for key in sorted(merged)])
        response["usage"] = self.usage.json()
        return response


def _merge_choice(into: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """A choice followed by its next part (text and logprobs appended; the latest finish)."""
    into["text"] += part["text"]
    if into["logprobs"] is not None and part["logprobs"] is not None:
        for name, values in part["logprobs"].items():
            into["logprobs"][name].extend(values)
    into["finish_reason"] = part["finish_reason"]
    into["stop_reason"] = part["stop_reason"]
    if into["prompt_logprobs"] is None:
        into["prompt_logprobs"] = part["prompt_logprobs"]
    return into


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _echo_only(request: CompletionRequest) -> bool:
    return request.echo and request.max_tokens == 0


async def beam_search_completion(
    serving: OpenAIServing,
    request: CompletionRequest,
    request_id: str,
    prompts: list[PreparedPrompt],
) -> dict[str, Any]:
    """``use_beam_search``: ``best_of`` beams (``n`` when unset) per prompt, the ``n`` best
    returned as its choices, best first (vLLM's beam search, see
    :mod:`pagedllm.core.beam_search`)."""
    width = request.best_of or request.n
    max_tokens = min(serving.max_tokens(request.max_tokens, p) for p in prompts)
    max_tokens = serving.sampling_defaults.cap(max_tokens)
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        temperature=request.temperature or 0.0,
        length_penalty=request.length_penalty,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )
    engine = serving.engine.engine
    eos = engine.loaded.eos_token_ids[0] if engine.loaded.eos_token_ids else None
    search = BeamSearch([p.token_ids for p in prompts], params, eos)
    step = 0
    while not search.done:
        beams = search.pending()
        outputs: list[Any] = [None] * len(beams)
        step_prompts = [PreparedPrompt(None, beam.tokens) for beam in beams]
        async for index, output in serving.generate_all(
            f"{request_id}-{step}",
            step_prompts,
            [search.step_params] * len(beams),
            request.priority,
            log=step == 0,
        ):
            if output.finished:
                outputs[index] = output
        search.advance(outputs)
        step += 1
    tokenizer = serving.tokenizer
    choices = []
    completion_tokens = 0
    for prompt_index, result in enumerate(search.results(None)):
        for rank, beam in enumerate(result.sequences[: request.n]):
            tokens = beam.output_tokens
            completion_tokens += len(tokens)
            text = ""
            if tokenizer is not None:
                keep_eos = request.include_stop_str_in_output or beam.finish_reason != "stop"
                text = tokenizer.decode(
                    tokens if keep_eos else tokens[:-1],
                    skip_special_tokens=request.skip_special_tokens,
                )
            choices.append(
                {
                    "index": prompt_index * request.n + rank,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": beam.finish_reason,
                    "stop_reason": None,
                }
            )
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": serving.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
