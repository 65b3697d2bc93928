"""The offline ``LLM`` class: generate for a batch of prompts in one call."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedllm.core.config import UsageContext
from pagedllm.core.engine import LLMEngine
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
)
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.plugins import PluginManager, make_plugin_manager
from pagedllm.core.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedllm.core.sampling import SamplingParams
from pagedllm.entrypoints.tracing import RequestTracer
from pagedllm.inputs import PromptType

if TYPE_CHECKING:
    import torch

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    """An LLM for generating texts from prompts: a tokenizer, a model and a paged KV
    cache, with continuous batching. The arguments are engine arguments (``EngineArgs``
    fields: ``dtype``, ``max_model_len``, ``enable_prefix_caching``, ...); those in the
    signature, vLLM's, may also be given by position, in its order. ``dtype`` and
    ``lora_dtype`` take a ``torch.dtype`` too, ``scheduler_cls`` a class.

    :meth:`shutdown` releases the engine; ``with LLM(...) as llm:`` calls it on leaving
    the block.
    """

    # (vLLM's parameters, in its documented order: each may be given by position too.)
    def __init__(
        self,
        model: str,
        tokenizer: str | None = EngineArgs.tokenizer,
        tokenizer_mode: str = EngineArgs.tokenizer_mode,
        skip_tokenizer_init: bool = EngineArgs.skip_tokenizer_init,
        trust_remote_code: bool = EngineArgs.trust_remote_code,
        allowed_local_media_path: str = EngineArgs.allowed_local_media_path,
        tensor_parallel_size: int = EngineArgs.tensor_parallel_size,
        dtype: str | torch.dtype = EngineArgs.dtype,
        quantization: str | None = EngineArgs.quantization,
        revision: str | None = EngineArgs.revision,
        tokenizer_revision: str | None = EngineArgs.tokenizer_revision,
        seed: int | None = EngineArgs.seed,
        gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization,
        swap_space: float = EngineArgs.swap_space,
        cpu_offload_gb: float = EngineArgs.cpu_offload_gb,
        enforce_eager: bool = EngineArgs.enforce_eager,
        max_seq_len_to_capture: int = EngineArgs.max_seq_len_to_capture,
        disable_custom_all_reduce: bool = EngineArgs.disable_custom_all_reduce,
        disable_async_output_proc: bool = EngineArgs.disable_async_output_proc,
        hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None,
        compilation_config: int | dict[str, Any] | None = EngineArgs.compilation_config,
        *,
        plugin_manager: PluginManager | None = None,
        **kwargs: Any,
    ):
        unknown = sorted(set(kwargs) - _ENGINE_FIELDS)
        if unknown:
            raise ConfigError(f"LLM() got unknown engine argument(s): {', '.join(unknown)}")
        if hf_overrides is not None:
            kwargs["hf_overrides"] = hf_overrides
        self.plugin_manager = plugin_manager or make_plugin_manager()
        engine_args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            tokenizer_mode=tokenizer_mode,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            allowed_local_media_path=allowed_local_media_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,  # (a torch.dtype: the type check takes its name)
            quantization=quantization,
            revision=revision,
            tokenizer_revision=tokenizer_revision,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            swap_space=swap_space,
            cpu_offload_gb=cpu_offload_gb,
            enforce_eager=enforce_eager,
            max_seq_len_to_capture=max_seq_len_to_capture,
            disable_custom_all_reduce=disable_custom_all_reduce,
            disable_async_output_proc=disable_async_output_proc,
            compilation_config=compilation_config,
            **kwargs,
        )
        config = engine_args.create_engine_config(self.plugin_manager, UsageContext.LLM_CLASS)
        # --otlp-traces-endpoint: a span per request, as from the server.
        self._tracer = RequestTracer.for_config(
            config.observability_config, config.model_config.served_model_name[0]
        )
        self._engine: LLMEngine | None = LLMEngine(config, self.plugin_manager)
        self._counter = 0

    @property
    def llm_engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("this LLM was shut down; create a new one to generate")
        return self._engine

    def shutdown(self) -> None:
        """Release the engine: its guided-decoding compiles stop and their worker
        processes and threads exit, and the model and the KV cache are freed (once
        nothing else refers to the engine). Calling it again does nothing; afterwards
        the LLM refuses to generate (:class:`EngineDeadError`)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._tracer is not None:
            self._tracer.shutdown()
        engine.shutdown()
        del engine
        # The engine's parts refer to each other (the stat logger to the engine): collect
        # the cycle now so the KV cache and weights go back to the allocator here.
        gc.collect()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prompt prefix (with --kv-events-config, subscribers get an
        AllBlocksCleared). False, and nothing changed, while a request holds blocks."""
        if reset_running_requests:
            raise ValueError(
                "reset_prefix_cache(reset_running_requests=True) is not supported: pagedllm "
                "resets the prefix cache only while no request holds blocks (it returns "
                "False otherwise)"
            )
        if reset_connector:
            raise ValueError(
                "reset_prefix_cache(reset_connector=True): pagedllm has no KV connector"
            )
        return self.llm_engine.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        ``lora_request`` (a :class:`~pagedllm.lora.LoRARequest`, or one per prompt, None
        for the base model) names the adapter each prompt runs with (``--enable-lora``)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        loras = lora_request if isinstance(lora_request, list | tuple) else None
        if loras is not None and len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        for params in params_list:
            self.llm_engine.check_params(params)  # a bad constraint fails before any runs
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                request_id = str(self._counter)
                self._counter += 1
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras is not None else lora_request,
                )
                self._started(request_id, params)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self._abort(request_ids)
            raise

    def _started(self, request_id: str, params: Any) -> None:
        if self._tracer is not None:
            self._tracer.start(request_id, params)

    def _abort(self, request_ids: list[str]) -> None:
        aborted = self.llm_engine.abort_request(request_ids)
        if self._tracer is not None:
            self._tracer.on_aborted(aborted)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        prompt_tokens = output_tokens = 0
        with bar:
            while self.llm_engine.has_unfinished_requests():
                outputs = self.llm_engine.step()
                if self._tracer is not None:
                    self._tracer.on_step(self.llm_engine, outputs)
                for request_id, exc in self.llm_engine.take_failures().items():
                    raise RequestFailedError(f"request {request_id} failed: {exc}") from exc
                for output in outputs:
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    bar.update(1)
                    prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):
                        output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"input: {prompt_tokens / elapsed:.1f} toks/s, "
                        f"output: {output_tokens / elapsed:.1f} toks/s"
                    )
        return [finished[i] for i in request_ids]

    # ---------------------------------------------------------------------- chat

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate (with
        ``lora_request`` as :meth:`generate` takes it). Image parts (``image_url``: a data
        URL, a file under ``allowed_local_media_path``, http; ``image_pil``) go to the
        model's multimodal processor."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template= to LLM.chat")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are exclusive")
        images = self._chat_images(conversation)
        if images:
            from pagedllm.entrypoints.openai.chat_utils import normalise_messages

            # (image parts become {"type": "image"}, as Hugging Face processors' templates
            # take them)
            messages = normalise_messages(conversation, "openai")
        else:
            messages = [_flatten_content(m) for m in conversation]
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
        if images:
            prompt["multi_modal_data"] = {"image": [item.image for item in images]}
            prompt["multi_modal_uuids"] = {"image": [item.hash for item in images]}
        return prompt

    def _chat_images(self, conversation: list[dict[str, Any]]) -> list[Any]:
        """The conversation's image parts (``image_url``: a data URL, a file under
        ``allowed_local_media_path``, http; ``image_pil``: a PIL image), loaded."""
        from pagedllm.entrypoints.media import MediaConnector, MediaError
        from pagedllm.entrypoints.openai.chat_images import check_image_count, image_parts
        from pagedllm.entrypoints.openai.errors import OpenAIError

        config = self.llm_engine.config
        try:
            parts = image_parts(conversation)
            check_image_count(parts, config.multimodal_config.max_images)
        except OpenAIError as exc:  # (the server's 400; here a ValueError, same words)
            raise ValueError(str(exc)) from None
        if not parts:
            return []
        connector = MediaConnector.from_config(config.model_config)
        images = []
        for part in parts:
            try:
                images.append(
                    connector.from_pil(part.image)
                    if part.url is None
                    else connector.load_image(part.url)
                )
            except MediaError as exc:
                raise ValueError(f"{part.param}: {exc}") from None
        return images

    # --------------------------------------------------------------- beam search

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best beams of each prompt (``sequences``, best first:
        ``tokens`` prompt included, ``cum_logprob``, ``text``), searched as vLLM does (see
        :mod:`pagedllm.core.beam_search`)."""
        engine = self.llm_engine
        prompt_list = _as_prompt_list(prompts)
        if any(isinstance(p, dict) and p.get("multi_modal_data") for p in prompt_list):
            raise InvalidRequestError("multi_modal_data", "beam search takes text prompts only")
        token_lists = [engine.tokenize_prompt(p)[1] for p in prompt_list]
        capped = engine.loaded.sampling_defaults.cap(params.max_tokens)
        params = dataclasses.replace(params, max_tokens=capped)
        eos = engine.loaded.eos_token_ids[0] if engine.loaded.eos_token_ids else None
        search = BeamSearch(token_lists, params, eos)
        from tqdm import tqdm

        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            while not search.done:
                beams = search.pending()
                step = [{"prompt_token_ids": beam.tokens} for beam in beams]
                search.advance(self.generate(step, search.step_params, use_tqdm=False))
                bar.update(1)
        return search.results(self.get_tokenizer())

    # ------------------------------------------------------------------- pooling

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """The pooled result of each prompt (``outputs.data``, a tensor) for the pooling
        task the engine serves (``--task embed|classify|score|reward``), or ``task``."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} PoolingParams for {len(prompt_list)} prompts"
                )
        params_list = [
            dataclasses.replace(
                params,
                task=task or params.task,
                truncate_prompt_tokens=truncate_prompt_tokens or params.truncate_prompt_tokens,
            )
            for params in params_list
        ]
        return self._run_requests(prompt_list, params_list, use_tqdm)

    def embed(self, prompts: Any, pooling_params: Any = None, **kwargs: Any) -> list[Any]:
        """An embedding of each prompt (``outputs.embedding``)."""
        outputs = self.encode(prompts, pooling_params, task="embed", **kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(self, prompts: Any, pooling_params: Any = None, **kwargs: Any) -> list[Any]:
        """Class probabilities of each prompt (``outputs.probs``)."""
        outputs = self.encode(prompts, pooling_params, task="classify", **kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(self, prompts: Any, pooling_params: Any = None, **kwargs: Any) -> list[Any]:
        """A reward model's scores of each prompt (``outputs.data``: one row per token
        with the default ``ALL`` pooler)."""
        return self.encode(prompts, pooling_params, task="reward", **kwargs)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A score for each pair: one ``text_1`` against every ``text_2``, or the two
        lists pairwise. A cross-encoder (a classification model) reads each pair as one
        prompt; an embedding model scores the cosine similarity of the two embeddings."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(
                f"score pairs one text_1 with every text_2, or lists of equal length; got "
                f"{len(firsts)} and {len(seconds)}"
            )
        engine = self.llm_engine
        params = pooling_params or PoolingParams()
        if "score" in engine.served_tasks:  # a cross-encoder
            tokenizer = self.get_tokenizer()
            prompts: list[PromptType] = []
            params_list = []
            for first, second in zip(firsts, seconds, strict=True):
                encoded = tokenizer(first, text_pair=second)
                prompts.append({"prompt_token_ids": list(encoded["input_ids"])})
                types = encoded.get("token_type_ids")
                params_list.append(
                    dataclasses.replace(params, token_type_ids=list(types) if types else None)
                )
            outputs = self.encode(
                prompts,
                params_list,
                use_tqdm=use_tqdm,
                truncate_prompt_tokens=truncate_prompt_tokens,
                task="score",
            )
            return [
                ScoringRequestOutput.from_score(o, o.outputs.data.reshape(-1)[0]) for o in outputs
            ]
        unique = list(dict.fromkeys([*firsts, *seconds]))
        embedded = self.encode(
            unique,
            params,
            use_tqdm=use_tqdm,
            truncate_prompt_tokens=truncate_prompt_tokens,
            task="embed",
        )
        vectors = {
            text: out.outputs.data.reshape(-1) for text, out in zip(unique, embedded, strict=True)
        }
        import torch

        results = []
        for first, second in zip(firsts, seconds, strict=True):
            similarity = torch.nn.functional.cosine_similarity(
                vectors[first], vectors[second], dim=0
            )
            base = embedded[unique.index(second)]
            results.append(ScoringRequestOutput.from_score(base, similarity.item()))
        return results

    def _run_requests(
        self, prompts: list[PromptType], params_list: list[Any], use_tqdm: bool
    ) -> list[Any]:
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = str(self._counter)
                self._counter += 1
                self.llm_engine.add_request(request_id, prompt, params)
                self._started(request_id, params)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self._abort(request_ids)
            raise

    # ---------------------------------------------------------------- sleep mode

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (needs ``enable_sleep_mode=True``): level 1 moves the
        weights out of the device's memory (on the cpu: to a file in
        ``PAGEDLLM_SLEEP_DIR``) and drops the KV cache; level 2 drops both (waking reloads
        the weights from the checkpoint). Unfinished requests are aborted; ``generate``
        raises until :meth:`wake_up`."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``tags`` name (``"weights"``, ``"kv_cache"``; None: both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping

    # -------------------------------------------------------------------- saving

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save this model's parameters for ``--load-format sharded_state``: files named
        by ``pattern`` (default ``model-rank-{rank}-part-{part}.safetensors``) of at most
        ``max_size`` bytes each (one file when None) in the directory ``path``, with the
        model directory's config and tokenizer files copied beside them. The parameters
        are read from the checkpoint afresh (the running ones may be repacked), so this
        needs the memory of a second copy of the weights while it runs. With
        tensor-parallel ranks or pipeline stages, each rank writes its own part
        (``{rank}``), which loads with the same parallel sizes."""
        from pagedllm.plugins.loaders.sharded_state import check_output, copy_model_files

        engine = self.llm_engine
        config = engine.config
        parallel = config.parallel_config
        ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        output = check_output(config, self.plugin_manager, path, pattern, max_size, ranks)
        engine.executor.save_sharded_state(output, pattern, max_size)
        copy_model_files(config, output)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """Text parts of a list-of-parts message joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"message content part of type {part.get('type')!r} is not supported")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
