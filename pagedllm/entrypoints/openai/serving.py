"""The OpenAI request handlers' shared state: the engine, the server options, the prompt
preparer, the checks a request passes before it reaches the engine, and ``/tokenize`` and
``/detokenize``. Completions and chat live in :mod:`.serving_completion` and
:mod:`.serving_chat`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagedllm.core.engine import NewRequest
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.multimodal import model_accepts_images
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling import SamplingParams
from pagedllm.entrypoints.media import LoadedImage, MediaConnector
from pagedllm.entrypoints.openai.chat_images import check_image_count, image_parts, load_images
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.logprobs import LogprobFormatter
from pagedllm.entrypoints.openai.prompts import PreparedPrompt, PromptPreparer
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.request_log import RequestLog
from pagedllm.entrypoints.openai.response_size import ResponseLimit
from pagedllm.entrypoints.openai.responses import Usage
from pagedllm.entrypoints.openai.serving_chat import create_chat_completion
from pagedllm.entrypoints.openai.serving_completion import create_completion
from pagedllm.entrypoints.tracing import incoming_trace_headers
from pagedllm.features.multimodal import MultiModalExtension

if TYPE_CHECKING:
    from pagedllm.core.engine_client import EngineClient
    from pagedllm.core.interfaces import ReasoningParser, ToolParser
    from pagedllm.core.pooling import PoolingParams
    from pagedllm.core.sampling.defaults import SamplingDefaults
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs
    from pagedllm.entrypoints.openai.serving_pooling import PoolingServing
    from pagedllm.entrypoints.openai.serving_responses import ResponsesServing
    from pagedllm.entrypoints.tracing import RequestTracer
    from pagedllm.lora.request import LoRARequest


class OpenAIServing:
    """Serves OpenAI requests with ``engine``, as the server ``options`` say.

    ``model_names`` are the served names (the first is the one responses report);
    ``chat_template`` is the loaded ``--chat-template`` text; ``tool_parser`` and
    ``reasoning_parser`` are the classes ``--tool-call-parser`` and
    ``--reasoning-parser`` name (instantiated per choice, as they keep streaming state).
    """

    def __init__(
        self,
        engine: EngineClient,
        options: FrontendArgs,
        *,
        model_names: list[str],
        chat_template: str | None = None,
        tool_parser: type[ToolParser] | None = None,
        reasoning_parser: type[ReasoningParser] | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = engine
        # --otlp-traces-endpoint: told of each request submitted (it exports their spans).
        self.tracer = tracer
        self.options = options
        self.model_names = list(model_names)
        # The LoRA adapters served (--lora-modules, or loaded at run time), by name.
        self.loras: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.request_log = RequestLog.for_options(options, logging.getLogger("pagedllm.server"))
        # --max-response-mb: the bound on one non-streaming response.
        self.response_limit = ResponseLimit(
            options.max_response_mb, self.tokenizer, engine.config.model_config.max_logprobs
        )
        self.prompts = PromptPreparer(
            self.tokenizer,
            self.max_model_len,
            engine.engine.vocab_size,
            chat_template=chat_template,
            content_format=options.chat_template_content_format,
        )
        self.media = MediaConnector.from_config(engine.config.model_config)

    @functools.cached_property
    def accepts_images(self) -> bool:
        # (the engine's plugins where it runs here; a data-parallel head's installed ones)
        pm = getattr(self.engine.engine, "pm", None)
        return model_accepts_images(self.engine.engine.loaded.hf_config, pm)

    @functools.cached_property
    def image_prompts(self) -> MultiModalExtension:
        """The engine's processing of prompts with images, for ``/tokenize`` to count their
        tokens as the engine prefills them (built here: a data-parallel head has no
        engine; made on first use)."""
        from pagedllm.core.plugins import make_plugin_manager

        info = self.engine.engine
        pm = getattr(info, "pm", None) or make_plugin_manager()
        names = set(pm.registry("multimodal_processors").names())
        architecture = getattr(info.loaded, "architecture", None) or next(
            a for a in info.loaded.hf_config.architectures if a in names
        )
        extension = MultiModalExtension.for_model(
            pm, self.engine.config, architecture, info.loaded.hf_config, self.tokenizer
        )
        assert extension is not None  # (accepts_images said so)
        return extension

    def expanded_token_ids(self, prompt: PreparedPrompt) -> list[int]:
        """``prompt``'s token ids with its images' placeholders expanded, as the engine
        prefills them (on a prompt thread: images are preprocessed)."""
        processed = self.image_prompts.process_prompt(
            prompt.engine_prompt(), prompt.token_ids, SamplingParams()
        )
        return prompt.token_ids if processed is None else processed[0]

    # ------------------------------------------------------------------- LoRA

    def _new_lora(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        from pagedllm.lora.request import LoRARequest

        if self.engine.config.lora_config is None:
            raise OpenAIError(400, "LoRA adapters need a server started with --enable-lora")
        if name in self.loras or name in self.model_names:
            raise OpenAIError(400, f"the model name {name!r} is already served", param="lora_name")
        request = LoRARequest(name, self._next_lora_id, path, base_model_name)
        self._next_lora_id += 1
        return request

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name``, loading it now (start-up, no
        event loop yet)."""
        request = self._new_lora(name, path, base_model_name)
        try:
            self.engine.load_lora(request).result()
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), param="lora_path") from None
        self.loras[name] = request
        return request

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """``/v1/load_lora_adapter``: as :meth:`add_lora`, loaded on the engine thread
        between steps."""
        request = self._new_lora(name, path, None)
        try:
            await asyncio.wrap_future(self.engine.load_lora(request))
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), param="lora_path") from None
        self.loras[name] = request
        return request

    async def unload_lora(self, name: str) -> None:
        request = self.loras.pop(name, None)
        if request is None:
            message = f"The LoRA adapter `{name}` does not exist."
            raise OpenAIError(404, message, "NotFoundError", param="lora_name")
        await asyncio.wrap_future(self.engine.unload_lora(request.lora_int_id))

    @functools.cached_property
    def pooling(self) -> PoolingServing:
        """The pooling endpoints' handlers (embeddings, scores, ...)."""
        from pagedllm.entrypoints.openai.serving_pooling import PoolingServing

        return PoolingServing(self)

    @functools.cached_property
    def responses(self) -> ResponsesServing:
        """The Responses API's handlers and their bounded store."""
        from pagedllm.entrypoints.openai.responses_store import ResponseStore, store_limit_bytes
        from pagedllm.entrypoints.openai.serving_responses import ResponsesServing

        return ResponsesServing(self, ResponseStore(store_limit_bytes()))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's sampling defaults and output cap (its generation config)."""
        return self.engine.engine.loaded.sampling_defaults

    def new_usage(self, prompts: list[PreparedPrompt]) -> Usage:
        return Usage(
            {i: len(p.token_ids) for i, p in enumerate(prompts)},
            self.options.enable_prompt_tokens_details,
        )

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names and model not in self.loras:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", "NotFoundError", param="model"
            )

    def check_sequences(self, num_prompts: int, request: Any) -> None:
        """The cap on prompts x n (--max-sequences-per-request), before any work."""
        per_prompt = request.best_of or request.n
        limit = self.options.max_sequences_per_request
        if num_prompts * per_prompt > limit:
            raise OpenAIError(
                400,
                f"this request asks for {num_prompts * per_prompt} sequences ({num_prompts} "
                f"prompt(s) x {per_prompt}); the server's limit is {limit} "
                f"(--max-sequences-per-request)",
                param="n" if num_prompts == 1 else "prompt",
            )

    def max_tokens(self, requested: int | None, prompt: PreparedPrompt) -> int | None:
        """The output budget: ``requested``, or what the context leaves; a request that
        does not fit is refused in the OpenAI API's words. A prompt with images is
        measured by the engine, once their placeholders are expanded (its budget is then
        ``requested`` as given: the engine refuses one that does not fit, in the same
        words, and gives None what its expanded prompt leaves)."""
        if prompt.images:
            return requested
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

    def as_ids(self, request: CompletionRequest | ChatCompletionRequest) -> bool:
        """``return_tokens_as_token_ids``: the request's choice, else the server's flag."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    async def chat_images(self, messages: list[Any]) -> list[LoadedImage]:
        """The images of chat ``messages``, checked and loaded: a 400 naming the part for
        a bad one, then (after every part was checked) if the model takes no images."""
        parts = image_parts(messages)
        if not parts:
            return []
        config = self.engine.config
        check_image_count(parts, config.multimodal_config.max_images)
        accepts = self.accepts_images
        images = await load_images(parts, self.media, keep=accepts)
        if not accepts:
            raise OpenAIError(
                400,
                f"model {self.model_name!r} does not accept image inputs",
                param=parts[0].param,
            )
        return images

    # -------------------------------------------------------------- generation

    async def generate_all(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        params_list: list[SamplingParams] | list[PoolingParams],
        priority: int,
        model: str | None = None,
        log: bool = True,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt, interleaved as they come, tagged with the prompt index
        (pooling requests' too). The prompts are queued together, so an invalid one queues
        none. ``model`` (the request's) picks a LoRA adapter when it names one. With
        ``log`` (and ``--enable-log-requests``) the prompts are logged once the engine has
        accepted them: a refused request's contents are never logged."""
        lora = self.loras.get(model) if model is not None else None
        ids = [request_id]
        if len(prompts) > 1:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        requests = [
            NewRequest(
                request_id=ids[i],
                prompt=prompt.engine_prompt(),
                params=params_list[i],
                priority=priority,
                extension_args={"lora_request": lora},
            )
            for i, prompt in enumerate(prompts)
        ]
        if self.tracer is not None:
            headers = incoming_trace_headers.get()
            for request in requests:
                self.tracer.start(request.request_id, request.params, headers, model)
        unlogged = log
        # (closed with this generator: a reply that stops reading aborts its requests)
        async with contextlib.aclosing(self.engine.generate_many(requests)) as outputs:
            async for item in outputs:
                if unlogged:  # (an output means every request was accepted)
                    unlogged = False
                    for request, prompt in zip(requests, prompts, strict=True):
                        self.request_log.accepted(
                            request.request_id, prompt.text, prompt.token_ids, request.params
                        )
                yield item

    # --------------------------------------------------------------- handlers

    async def create_completion(self, request: CompletionRequest, request_id: str) -> Any:
        """``/v1/completions``: a response dict, or an SSE stream with ``stream``."""
        return await create_completion(self, request, request_id)

    async def create_chat_completion(self, request: ChatCompletionRequest, request_id: str) -> Any:
        """``/v1/chat/completions``: a response dict, or an SSE stream with ``stream``."""
        return await create_chat_completion(self, request, request_id)

    async def create_tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            images = await self.chat_images(body.messages)
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
            prompt = await self.prompts.run(self.prompts.chat_prompt, chat)
            tokens = prompt.token_ids
            if body.mm_processor_kwargs and not self.accepts_images:
                raise OpenAIError(
                    400,
                    "mm_processor_kwargs: this model takes text only",
                    param="mm_processor_kwargs",
                )
            if images or body.mm_processor_kwargs:
                # (counted as the engine takes them: each image's placeholder expanded)
                prompt = dataclasses.replace(
                    prompt, images=images, mm_processor_kwargs=body.mm_processor_kwargs
                )
                tokens = await self.prompts.run(self.expanded_token_ids, prompt)
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
