"""``/v1/completions`` and ``/v1/chat/completions``: requests to engine calls, outputs to
OpenAI responses and server-sent-event streams."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagedllm.core.async_engine import AsyncLLMEngine, NewRequest
from pagedllm.core.interfaces import new_tool_call_id
from pagedllm.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.core.sampling import GuidedDecodingParams
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.prompts import PreparedPrompt, PromptPreparer
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from pagedllm.entrypoints.openai.tool_choice import (
    forced_calls,
    forced_tool_schema,
    openai_tool_call,
)


@dataclasses.dataclass(slots=True)
class ServingSettings:
    served_model_names: list[str]
    response_role: str
    chat_template: str | None
    chat_template_content_format: str
    return_tokens_as_token_ids: bool
    enable_prompt_tokens_details: bool
    max_logprobs: int
    # --reasoning-parser: a ReasoningParser class, instantiated per chat choice.
    # --max-sequences-per-request: prompts x n (or best_of) in one request.
    max_sequences_per_request: int = 256
    reasoning_parser: Any = None
    # --tool-call-parser (a ToolParser class) and --enable-auto-tool-choice.
    tool_parser: Any = None
    enable_auto_tool_choice: bool = False


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, settings: ServingSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.prompts = PromptPreparer(
            self.tokenizer,
            self.max_model_len,
            engine.engine.vocab_size,
            chat_template=settings.chat_template,
            content_format=settings.chat_template_content_format,
        )

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", "NotFoundError", param="model"
            )

    # ----------------------------------------------------------------- prompts

    def _check_sequences(self, num_prompts: int, request: Any) -> None:
        """The cap on prompts x n (--max-sequences-per-request), before any work."""
        per_prompt = request.best_of or request.n
        limit = self.settings.max_sequences_per_request
        if num_prompts * per_prompt > limit:
            raise OpenAIError(
                400,
                f"this request asks for {num_prompts * per_prompt} sequences ({num_prompts} "
                f"prompt(s) x {per_prompt}); the server's limit is {limit} "
                f"(--max-sequences-per-request)",
                param="n" if num_prompts == 1 else "prompt",
            )

    def _max_tokens(self, requested: int | None, prompt: PreparedPrompt) -> int:
        prompt_len = len(prompt.token_ids)
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {prompt_len} input tokens. Please reduce the "
                f"length of the input messages.",
                param="messages",
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                f"the messages, {requested} in the completion). Please reduce the length of "
                f"the messages or completion.",
                param="max_tokens",
            )
        return requested

    def _check_logprobs(self, count: int | None, param: str) -> None:
        limit = self.settings.max_logprobs
        if count is not None and limit != -1 and count > limit:
            raise OpenAIError(
                400, f"{param}={count} exceeds the server's --max-logprobs={limit}", param=param
            )

    # ---------------------------------------------------------------- logprobs

    def _as_ids(self, request: CompletionRequest | ChatCompletionRequest) -> bool:
        """``return_tokens_as_token_ids``: the request's choice, else the server's flag."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.settings.return_tokens_as_token_ids

    def _token_text(self, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if logprob is None:
            return self.tokenizer.decode([token_id]) if self.tokenizer else ""
        return logprob.decoded_token if logprob.decoded_token is not None else ""

    def _chat_logprobs(
        self,
        token_ids: list[int],
        positions: list[dict[int, Logprob]],
        top: int,
        as_ids: bool,
    ) -> dict[str, Any]:
        content = []
        for token_id, position in zip(token_ids, positions, strict=False):
            chosen = position[token_id]
            text = self._token_text(token_id, chosen, as_ids)
            ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top]
            content.append(
                {
                    "token": text,
                    "logprob": max(chosen.logprob, -9999.0),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(tid, lp, as_ids)),
                            "logprob": max(lp.logprob, -9999.0),
                            "bytes": list(t.encode("utf-8")),
                        }
                        for tid, lp in ranked
                        if lp.rank is not None and lp.rank <= top
                    ],
                }
            )
        return {"content": content}

    def _choice_logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput, top: int
    ) -> dict[str, Any] | None:
        """A chat choice's (or chunk's) ``logprobs``, when the request asked for them."""
        if not request.logprobs:
            return None
        return self._chat_logprobs(
            completion.token_ids, completion.logprobs or [], top, self._as_ids(request)
        )

    def _completion_logprobs(
        self,
        token_ids: list[int],
        positions: list[dict[int, Logprob] | None],
        top: int,
        text_offset: int,
        as_ids: bool,
    ) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:  # the first prompt token has no logprob
                text = self._token_text(token_id, None, as_ids)
                tokens.append(text)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = position[token_id]
                text = self._token_text(token_id, chosen, as_ids)
                tokens.append(text)
                token_logprobs.append(max(chosen.logprob, -9999.0))
                top_logprobs.append(
                    {
                        self._token_text(tid, lp, as_ids): max(lp.logprob, -9999.0)
                        for tid, lp in position.items()
                        if tid == token_id or (lp.rank is not None and lp.rank <= top)
                    }
                )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ usage

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.settings.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    # -------------------------------------------------------------- generation

    async def _generate_all(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        params_list: list[Any],
        priority: int,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt, interleaved as they come, tagged with the prompt index.
        The prompts are queued together, so an invalid one queues none."""
        ids = [request_id]
        if len(prompts) > 1:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        requests = [
            NewRequest(
                request_id=ids[i],
                prompt={"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                params=params_list[i],
                priority=priority,
            )
            for i, prompt in enumerate(prompts)
        ]
        async for item in self.engine.generate_many(requests):
            yield item

    # ------------------------------------------------------------- tokenizing

    async def create_tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            try:
                chat = ChatCompletionRequest(
                    messages=body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    add_special_tokens=body.add_special_tokens,
                    chat_template=body.chat_template,
                    chat_template_kwargs=body.chat_template_kwargs,
                )
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from exc
            tokens = (await self.prompts.run(self.prompts.chat_prompt, chat)).token_ids
        else:
            tokens = await self.prompts.run(
                self.prompts.tokenize, body.prompt or "", body.add_special_tokens
            )
        result: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            result["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return result

    async def create_detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if self.tokenizer is None:
            raise OpenAIError(400, "the server runs with --skip-tokenizer-init")
        self.prompts.check_token_ids(body.tokens, "tokens")
        return {"prompt": await self.prompts.run(self.tokenizer.decode, body.tokens)}

    # ------------------------------------------------------------- completions

    async def create_completion(self, request: CompletionRequest, request_id: str) -> Any:
        self.check_model(request.model)
        self._check_logprobs(request.logprobs, "logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        self._check_sequences(_num_prompts(request.prompt), request)
        prompts = await self.prompts.run(self.prompts.completion_prompts, request)
        defaults = self.engine.engine.loaded.generation_defaults
        # echo with max_tokens=0 scores the prompt (as lm-eval does): one token is
        # computed and dropped, as in vLLM.
        max_tokens = 1 if _echo_only(request) else request.max_tokens
        params_list = []
        for prompt in prompts:
            params = request.sampling_params(
                self._max_tokens(max_tokens, prompt), request.logprobs, defaults
            )
            if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
                params.prompt_logprobs = request.logprobs
            params_list.append(params)
        n = request.n
        generator = self._generate_all(request_id, prompts, params_list, request.priority)
        created, model = now(), self.model_name
        if request.stream:
            return self._stream_completion(
                request, request_id, created, model, prompts, generator, n
            )
        final: dict[int, RequestOutput] = {}
        async for index, output in generator:
            final[index] = output
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for index, prompt in enumerate(prompts):
            output = final[index]
            prompt_tokens += len(output.prompt_token_ids)
            cached += output.num_cached_tokens
            for completion in sorted(output.outputs, key=lambda c: c.index):
                completion_tokens += 0 if _echo_only(request) else len(completion.token_ids)
                choices.append(
                    self._completion_choice(request, prompt, output, completion, index * n)
                )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": self._usage(prompt_tokens, completion_tokens, cached),
        }

    def _completion_choice(
        self,
        request: CompletionRequest,
        prompt: PreparedPrompt,
        output: RequestOutput,
        completion: CompletionOutput,
        base_index: int,
        *,
        text: str | None = None,
        token_ids: list[int] | None = None,
        positions: list[Any] | None = None,
        echo: bool | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        text = completion.text if text is None else text
        token_ids = completion.token_ids if token_ids is None else token_ids
        positions = completion.logprobs if positions is None else positions
        if _echo_only(request):
            text, token_ids, positions = "", [], []
        echo = request.echo if echo is None else echo
        logprobs = None
        prefix = (prompt.text or "") if echo else ""
        if request.logprobs is not None:
            ids, pos = list(token_ids), list(positions or [])
            if echo:
                ids = list(output.prompt_token_ids) + ids
                pos = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + pos
            logprobs = self._completion_logprobs(
                ids, pos, request.logprobs, text_offset, self._as_ids(request)
            )
        return {
            "index": base_index + completion.index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "prompt_logprobs": _prompt_logprobs_json(output) if request.prompt_logprobs else None,
        }

    async def _stream_completion(
        self, request, request_id, created, model, prompts, generator, n
    ) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        prompt_tokens = {i: len(p.token_ids) for i, p in enumerate(prompts)}
        completion_tokens: dict[tuple[int, int], int] = {}
        cached: dict[int, int] = {}
        echoed: set[tuple[int, int]] = set()
        # Where each choice's next token starts, so streamed text_offset values continue
        # across chunks as they run in the non-streamed response.
        offsets: dict[tuple[int, int], int] = {}
        async for index, output in generator:
            cached[index] = output.num_cached_tokens
            for completion in output.outputs:
                key = (index, completion.index)
                generated = 0 if _echo_only(request) else len(completion.token_ids)
                completion_tokens[key] = completion_tokens.get(key, 0) + generated
                echo = request.echo and key not in echoed
                echoed.add(key)
                choice = self._completion_choice(
                    request,
                    prompts[index],
                    output,
                    completion,
                    index * n,
                    echo=echo,
                    text_offset=offsets.get(key, 0),
                )
                logprobs = choice["logprobs"]
                if logprobs is not None and logprobs["tokens"]:
                    offsets[key] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                chunk: dict[str, Any] = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                if include_usage and continuous:
                    chunk["usage"] = self._usage(
                        sum(prompt_tokens.values()),
                        sum(completion_tokens.values()),
                        sum(cached.values()),
                    )
                yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(
                        sum(prompt_tokens.values()),
                        sum(completion_tokens.values()),
                        sum(cached.values()),
                    ),
                }
            )
        yield sse("[DONE]")

    # -------------------------------------------------------------------- chat

    def _auto_tools(self, request: ChatCompletionRequest) -> bool:
        """Whether the model's own tool calls are parsed (tool_choice "auto", which is
        the default with tools when the server enables it)."""
        enabled = self.settings.enable_auto_tool_choice and self.settings.tool_parser
        if request.tool_choice == "auto" and not enabled:
            raise OpenAIError(
                400,
                'tool_choice="auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser; use none, required or a named function",
                param="tool_choice",
            )
        return bool(enabled and request.tools and request.tool_choice in (None, "auto"))

    def _role(self, request: ChatCompletionRequest) -> str:
        if request.add_generation_prompt:
            return self.settings.response_role
        return request.messages[-1].get("role", self.settings.response_role)

    @staticmethod
    def _reasoning_delta(parser: Any, text: str, delta_text: str, last: bool) -> dict[str, Any]:
        """The delta to send: reasoning and content split by the parser; at the end,
        whatever it held back (a possible marker) is sent too."""
        previous = text[: len(text) - len(delta_text)]
        step = parser.extract_reasoning_content_streaming(previous, text, delta_text, [], [], [])
        flushed = parser.flush_streaming(text) if last else None
        return _merge_deltas(step, flushed)

    async def create_chat_completion(self, request: ChatCompletionRequest, request_id: str) -> Any:
        self.check_model(request.model)
        top = request.top_logprobs or 0
        if request.logprobs:
            self._check_logprobs(top, "top_logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        self._check_sequences(1, request)
        prompt = await self.prompts.run(self.prompts.chat_prompt, request)
        requested = request.max_completion_tokens or request.max_tokens
        params = request.sampling_params(
            self._max_tokens(requested, prompt),
            top if request.logprobs else None,
            self.engine.engine.loaded.generation_defaults,
        )
        named, schema = forced_tool_schema(
            request.tools, request.tool_choice, request.parallel_tool_calls
        )
        forced = schema is not None
        if forced:
            if params.guided_decoding is not None:
                raise OpenAIError(
                    400,
                    f"tool_choice={request.tool_choice!r} cannot be combined with "
                    f"response_format or guided decoding",
                    param="tool_choice",
                )
            params.guided_decoding = GuidedDecodingParams(json=schema)
        auto_parsers = None
        if self._auto_tools(request):
            auto_parsers = [self.settings.tool_parser(self.tokenizer) for _ in range(params.n)]
            for parser in auto_parsers:
                request = parser.adjust_request(request)
            params.skip_special_tokens = False  # call markers are often special tokens
        generator = self._generate_all(request_id, [prompt], [params], request.priority)
        created, model, role = now(), self.model_name, self._role(request)
        reasoning = self._reasoning_parsers(prompt, params.n)
        tools: Any = None
        if forced:
            tools = ToolStream(named)
        elif auto_parsers is not None:
            tools = AutoToolStream(auto_parsers, request)
        echo_text = ""
        if request.echo and request.messages[-1].get("role") == role:
            content = request.messages[-1].get("content")
            echo_text = content if isinstance(content, str) else ""
        if request.stream:
            return self._stream_chat(
                request, request_id, created, model, role, generator, echo_text, reasoning, tools
            )
        final = None
        async for _, output in generator:
            final = output
        assert final is not None
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            message: dict[str, Any] = {
                "role": role,
                "content": echo_text + completion.text,
                "tool_calls": [],
            }
            finish_reason = completion.finish_reason
            if reasoning is not None:
                thought, answer = reasoning[completion.index].extract_reasoning_content(
                    completion.text, request
                )
                message["reasoning_content"] = thought
                message["content"] = echo_text + answer if answer else (echo_text or None)
            if forced:
                calls = forced_calls(named, message["content"] or "")
                if calls:
                    message["content"] = None
                    message["tool_calls"] = [openai_tool_call(call) for call in calls]
                    if named is None and finish_reason == "stop":
                        finish_reason = "tool_calls"
            elif auto_parsers is not None and message["content"]:
                found = auto_parsers[completion.index].extract_tool_calls(
                    message["content"], request
                )
                if found.tools_called:
                    message["content"] = found.content
                    calls = found.tool_calls
                    if request.parallel_tool_calls is False:
                        calls = calls[:1]  # one call per turn, as asked
                    message["tool_calls"] = [openai_tool_call(call) for call in calls]
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            choices.append(
                {
                    "index": completion.index,
                    "message": message,
                    "logprobs": self._choice_logprobs(request, completion, top),
                    "finish_reason": finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": self._usage(
                len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens
            ),
        }
        if request.prompt_logprobs:
            response["prompt_logprobs"] = _prompt_logprobs_json(final)
        return response

    def _reasoning_parsers(self, prompt: PreparedPrompt, n: int) -> list[Any] | None:
        """One reasoning parser per choice (they keep streaming state), told whether the
        chat template already opened the reasoning in the prompt."""
        cls = self.settings.reasoning_parser
        if cls is None:
            return None
        return [cls.for_prompt(self.tokenizer, prompt.text) for _ in range(n)]

    async def _stream_chat(
        self,
        request,
        request_id,
        created,
        model,
        role,
        generator,
        echo_text,
        reasoning=None,
        tools=None,
    ) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        top = request.top_logprobs or 0
        started: set[int] = set()
        prompt_tokens = completion_tokens = cached = 0
        texts: dict[int, str] = defaultdict(str)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            data: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            return sse(data)

        async for _, output in generator:
            prompt_tokens = len(output.prompt_token_ids)
            cached = output.num_cached_tokens
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                usage = (
                    self._usage(prompt_tokens, completion_tokens, cached)
                    if include_usage and continuous
                    else None
                )
                if completion.index not in started:
                    started.add(completion.index)
                    first = {"role": role, "content": echo_text}
                    yield chunk(
                        [
                            {
                                "index": completion.index,
                                "delta": first,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        usage,
                    )
                if (
                    not completion.text
                    and not completion.token_ids
                    and not completion.finish_reason
                ):
                    continue
                delta: dict[str, Any] = {"content": completion.text} if completion.text else {}
                finish_reason = completion.finish_reason
                if reasoning is not None:
                    texts[completion.index] += completion.text
                    delta = self._reasoning_delta(
                        reasoning[completion.index],
                        texts[completion.index],
                        completion.text,
                        bool(completion.finish_reason),
                    )
                if tools is not None:
                    delta, finish_reason = tools.delta(
                        completion.index, delta, completion.finish_reason
                    )
                yield chunk(
                    [
                        {
                            "index": completion.index,
                            "delta": delta,
                            "logprobs": self._choice_logprobs(request, completion, top),
                            "finish_reason": finish_reason,
                            "stop_reason": completion.stop_reason,
                        }
                    ],
                    usage,
                )
        if include_usage:
            yield chunk([], self._usage(prompt_tokens, completion_tokens, cached))
        yield sse("[DONE]")


class ToolStream:
    """Streams a forced tool choice as OpenAI tool-call deltas: a named function's
    arguments as they are generated; ``required`` calls once the array is complete."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self.texts: dict[int, str] = defaultdict(str)
        self.started: set[int] = set()

    def delta(
        self, index: int, delta: dict[str, Any], finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        text = delta.get("content") or ""
        self.texts[index] += text
        out: dict[str, Any] = {k: v for k, v in delta.items() if k != "content"}
        if self.named is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if index not in self.started:
                self.started.add(index)
                call.update(id=new_tool_call_id(), type="function")
                call["function"]["name"] = self.named
            if text or len(call) > 2:
                out["tool_calls"] = [call]
            return out, finish_reason
        if finish_reason is not None:
            calls = forced_calls(None, self.texts[index])
            if calls:
                out["tool_calls"] = [
                    dict(openai_tool_call(call), index=i) for i, call in enumerate(calls)
                ]
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        return out, finish_reason


class AutoToolStream:
    """Streams the model's own tool calls (tool_choice "auto") through the tool parser:
    content deltas become content and tool-call deltas in the OpenAI format."""

    def __init__(self, parsers: list[Any], request: Any) -> None:
        self.parsers = parsers
        self.request = request
        self.texts: dict[int, str] = defaultdict(str)
        self.called: set[int] = set()

    def delta(
        self, index: int, delta: dict[str, Any], finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        parser = self.parsers[index]
        piece = delta.get("content") or ""
        previous = self.texts[index]
        self.texts[index] = current = previous + piece
        out: dict[str, Any] = {k: v for k, v in delta.items() if k != "content"}
        messages = []
        if piece:
            messages.append(
                parser.extract_tool_calls_streaming(
                    previous, current, piece, [], [], [], self.request
                )
            )
        if finish_reason is not None:
            messages.append(parser.flush_streaming(current))
        for message in messages:
            if message is None:
                continue
            if message.content:
                out["content"] = out.get("content", "") + message.content
            for call in message.tool_calls:
                if call.index > 0 and getattr(self.request, "parallel_tool_calls", None) is False:
                    continue  # one call per turn, as asked
                self.called.add(index)
                entry: dict[str, Any] = {"index": call.index, "function": {}}
                if call.id:
                    entry.update(id=call.id, type=call.type or "function")
                if call.name is not None:
                    entry["function"]["name"] = call.name
                if call.arguments is not None:
                    entry["function"]["arguments"] = call.arguments
                out.setdefault("tool_calls", []).append(entry)
        if finish_reason == "stop" and index in self.called:
            finish_reason = "tool_calls"
        return out, finish_reason


def _merge_deltas(*deltas: Any) -> dict[str, Any]:
    """One OpenAI delta from reasoning-parser DeltaMessages (None ones skipped)."""
    merged: dict[str, Any] = {}
    for delta in deltas:
        if delta is None:
            continue
        for key in ("reasoning_content", "content"):
            value = getattr(delta, key)
            if value:
                merged[key] = merged.get(key, "") + value
    return merged


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _echo_only(request: CompletionRequest) -> bool:
    return request.echo and request.max_tokens == 0


def _prompt_logprobs_json(output: RequestOutput) -> list[Any] | None:
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in position.items()
        }
        for position in output.prompt_logprobs
    ]
