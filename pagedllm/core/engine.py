"""``LLMEngine``: requests in, ``RequestOutput``s out, one scheduler step at a time."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from pagedllm.core.args.validate import attention_backend_name
from pagedllm.core.batch_invariance import check_batch_invariance
from pagedllm.core.config import ParallelConfig, scheduler_class
from pagedllm.core.errors import ConfigError, EngineDeadError, InvalidRequestError
from pagedllm.core.guided import GuidedDecodingManager
from pagedllm.core.interfaces.executor import Executor, executor_class
from pagedllm.core.interfaces.extension import StepExtension
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.kv_cache.spec import kv_cache_spec, kv_cache_torch_dtype
from pagedllm.core.model_files import resolve_model_path
from pagedllm.core.model_setup import (
    load_model,
    num_kv_blocks,
)
from pagedllm.core.output_processor import OutputProcessor, ParentRequest
from pagedllm.core.outputs import RequestMetrics, RequestOutput
from pagedllm.core.pooling import (
    POOLING_TASKS,
    PoolerConfig,
    PoolingParams,
    resolve_task,
    sentence_transformers_pooler,
)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner import ModelRunner
from pagedllm.core.sampling import SamplingParams
from pagedllm.core.sampling.guided_params import as_guided_params
from pagedllm.core.stats import StatLogger
from pagedllm.core.step_data import RunnerOutput
from pagedllm.core.step_extensions import build_step_extensions

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.inputs import PromptType

logger = logging.getLogger("pagedllm.engine")


@dataclasses.dataclass(slots=True)
class NewRequest:
    """What :meth:`LLMEngine.add_requests` takes for one request."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    lora_request: Any = None


class LLMEngine:
    """Requests in, ``RequestOutput``s out. Each :meth:`step` is schedule → execute →
    update → output: the scheduler picks the tokens (and the blocks) of the step, the
    model runner computes them, the scheduler's update advances the requests, and the
    output processor (which holds the live requests) turns them into outputs."""

    def __init__(self, config: PagedLLMConfig, pm: PluginManager) -> None:
        # The ranks that compute the model (--distributed-executor-backend): with -tp N /
        # -pp N, ranks 1..N-1 start first (they build their shards or stages of the model
        # while this process, rank 0, builds its own).
        backend = config.parallel_config.distributed_executor_backend
        self.executor: Executor = executor_class(backend, pm)(config, pm)
        # An engine still alive when the interpreter exits stops its ranks first (the
        # workers exit, this process leaves their group) rather than leave them to the
        # interpreter's teardown, where a live collective group can abort the process.
        self._stop_executor = weakref.finalize(self, self.executor.shutdown)
        try:
            self._build(config, pm)
        except BaseException:
            self._stop_executor()
            raise

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (its KV cache, its model)."""
        return self.executor.runner

    def _build(self, config: PagedLLMConfig, pm: PluginManager) -> None:
        import torch

        self.config = config
        self.pm = pm
        if config.model_config.seed is not None:
            torch.manual_seed(config.model_config.seed)
        cache = config.cache_config
        # (Checked before the model loads, the long part.)
        backend_cls = pm.load(
            "attention_backends", attention_backend_name(config.device_config.device, pm)
        )
        if cache.kv_cache_dtype not in backend_cls.kv_cache_dtypes:
            raise ConfigError(
                f"--kv-cache-dtype {cache.kv_cache_dtype}: the {backend_cls.name} attention "
                f"backend of this device stores {', '.join(backend_cls.kv_cache_dtypes)} only"
            )
        if config.model_config.batch_invariant:  # (what can be said before the load)
            check_batch_invariance(config, backend_cls())
        loaded = self.executor.load_model()
        # When each rank loaded its weights (rank 0 first; empty with one rank).
        self.rank_loading = self.executor.rank_loading
        self.lora = self.executor.lora
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.hf_config.vocab_size
        mc = config.model_config
        self.task = resolve_task(mc.task, loaded.model, mc.runner, mc.convert)
        self.pooler_configs = self._set_up_pooling(loaded.model) if self.is_pooling else {}
        config, cache = self.config, self.config.cache_config  # (pooling's copy)
        # (every rank holds num_blocks blocks of its KV cache)
        spec, bytes_per_block = self.executor.kv_cache_layout(loaded)
        device = config.device_config.device
        check_batch_invariance(config, backend_cls(), loaded.model, spec.dtype)
        # Decode steps replayed from graphs: generation without adapters, on a device that
        # captures them, unless --enforce-eager (then capture_sizes is empty).
        use_graphs = (
            device.captures_graphs
            and bool(config.compilation_config.capture_sizes)
            and not self.is_pooling
            and config.lora_config is None
            and self.executor.num_ranks == 1
        )
        # The draft model takes its memory before the KV cache is sized from what is left
        # (as the adapters' slots, which the executor's workers made).
        speculative = config.speculative_config
        draft = None
        if speculative is not None:
            from pagedllm.core.spec_decode import speculation_limit

            if speculative.method == "draft_model":
                draft = self._load_draft(speculative)
            draft_len = None if draft is None else draft[0].max_model_len
            speculative = speculation_limit(speculative, self.max_model_len, draft_len)
        if draft is not None:
            bytes_per_block += draft[1].bytes_per_block(cache.block_size)
        if cache.num_gpu_blocks_override is None:
            sched = config.scheduler_config
            device.measure_peak_memory(
                functools.partial(
                    self.executor.profile,
                    spec,
                    block_size=cache.block_size,
                    num_tokens=sched.max_num_batched_tokens,
                    num_seqs=sched.max_num_seqs,
                    max_model_len=self.max_model_len,
                )
            )
        num_blocks = num_kv_blocks(
            config, bytes_per_block, self.max_model_len, reserved=int(use_graphs)
        )
        self.kv_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.guided: GuidedDecodingManager | None = None
        if self.tokenizer is not None:
            self.guided = GuidedDecodingManager(
                pm,
                config.decoding_config,
                self.tokenizer,
                self.vocab_size,
                tuple(loaded.eos_token_ids),
            )
        self.executor.init_cache(
            spec, num_blocks, pooler_configs=self.pooler_configs, graphs=use_graphs
        )
        self.speculative = speculative
        self.draft_proposer = None
        if draft is not None:
            from pagedllm.core.spec_decode import DraftModelProposer

            self.draft_proposer = DraftModelProposer(
                draft[0].model,
                draft[1],
                num_blocks,
                cache.block_size,
                backend_cls(),
                config.device_config.torch_device,
                self.vocab_size,
            )
        # The step extensions the configuration turns on (LoRA, speculative decoding,
        # pooling, guided decoding, a plugin's), by name.
        self.extensions = {e.name: e for e in build_step_extensions(self)}
        base_hook = StepExtension.new_request
        self._new_request_hooks = [
            e for e in self.extensions.values() if type(e).new_request is not base_hook
        ]
        sched = config.scheduler_config
        self.scheduler = scheduler_class(sched.scheduler_cls, pm)(
            sched, self.kv_manager, self.max_model_len, extensions=list(self.extensions.values())
        )
        self.stat_logger = StatLogger(
            self, enabled=not config.observability_config.disable_log_stats
        )
        self.output_processor = OutputProcessor(self.tokenizer, pm, self.stat_logger)
        self._ids = itertools.count()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            num_blocks * spec.bytes_per_block(cache.block_size) / 2**30,
            str(spec.dtype).removeprefix("torch."),
        )
        pm.hook.pagedllm_engine_started(engine=self)
        # Everything built so far (modules, weights' wrappers, plugins, the tokenizer)
        # lives as long as the engine: out of the cyclic collector's way, which otherwise
        # walks it again at every full collection (3-4% of a batched decode step's time,
        # measured on the default model at 64 sequences). shutdown() gives it back, and so
        # does the interpreter's exit (whose last collections free what is still alive).
        gc.freeze()
        _unfreeze_at_exit()

    def _load_draft(self, spec: Any) -> tuple[Any, Any]:
        """Load ``spec.model`` as the draft model: ``(loaded model, its KV-cache spec)``
        (its cache gets the target's block layout). With tensor-parallel ranks or
        pipeline stages it is whole in this process (rank 0, which proposes), as vLLM's
        ``draft_tensor_parallel_size`` 1."""
        import torch

        config = self.config
        mc = config.model_config
        # (Its own context: sequences longer than it are not speculated. It schedules
        # nothing, so the target's batch limits do not constrain it.)
        draft_config = dataclasses.replace(
            config,
            model_config=dataclasses.replace(
                mc,
                model=spec.model,
                tokenizer=spec.model,
                quantization=None,
                task="generate",
                max_model_len=None,
            ),
            scheduler_config=dataclasses.replace(
                config.scheduler_config, enable_chunked_prefill=True
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
                distributed_executor_backend="uni",
            ),
            speculative_config=None,
        )
        threads = torch.get_num_threads()  # (this rank's share, which loading resets)
        try:
            try:
                draft = load_model(draft_config, self.pm)
            except ConfigError as exc:
                if "states no context length" not in str(exc):
                    raise
                # A draft whose config states none runs within the speculative config's
                # max_model_len, else the target's context (as it did before drafts had
                # their own).
                length = spec.max_model_len or self.max_model_len
                draft_config = dataclasses.replace(
                    draft_config,
                    model_config=dataclasses.replace(
                        draft_config.model_config, max_model_len=length
                    ),
                )
                draft = load_model(draft_config, self.pm)
        finally:
            torch.set_num_threads(threads)
        ours, theirs = self.tokenizer, draft.tokenizer
        if ours is not None and theirs is not None and ours.get_vocab() != theirs.get_vocab():
            raise ConfigError(
                f"--speculative-config: the draft model {spec.model!r} has another vocabulary"
            )
        spec_kv = kv_cache_spec(
            draft.hf_config,
            kv_cache_torch_dtype(config.cache_config, draft.dtype),
            model=draft.model,
        )
        logger.info("speculative decoding: draft model %s", spec.model)
        return draft, spec_kv

    @property
    def is_pooling(self) -> bool:
        """Whether the engine serves a pooling task rather than generation."""
        return self.task in POOLING_TASKS

    def _set_up_pooling(self, model: Any) -> dict[str, PoolerConfig]:
        """The pooler of each task the model serves (its defaults under
        ``--override-pooler-config``). Pooling prompts run whole: no chunked prefill and
        no prefix cache (a prompt's pooled rows need every token's hidden state)."""
        config = self.config
        override = PoolerConfig.from_dict(dict(config.model_config.override_pooler_config or {}))
        sched = config.scheduler_config
        if config.cache_config.enable_prefix_caching or sched.enable_chunked_prefill:
            logger.info("--task %s: prompts run whole (no prefix caching or chunks)", self.task)
        # (The validated configuration is frozen: the engine runs with a changed copy.)
        self.config = config.replace(
            cache_config=config.cache_config.replace(enable_prefix_caching=False),
            scheduler_config=sched.replace(
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(sched.max_num_batched_tokens, self.max_model_len),
            ),
        )
        directory = resolve_model_path(
            config.model_config.model,
            revision=config.model_config.revision,
            download_dir=config.load_config.download_dir,
        )
        sentence = sentence_transformers_pooler(
            directory if directory.is_dir() else directory.parent
        )
        configs = {}
        for task in model.pooling_tasks:
            defaults = model.default_pooler_config(task)
            if task == "embed" and sentence is not None:
                defaults = defaults.merged(sentence)
            configs[task] = defaults.merged(override)
        return configs

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One step. A failure while computing it fails only the requests it scheduled
        (see :meth:`take_failures`); the engine goes on with the others."""
        scheduler_output = self.scheduler.schedule()
        result = RunnerOutput()
        if not scheduler_output.is_empty:
            try:
                token_mask = self.scheduler.token_mask(scheduler_output)
                result = self.executor.execute(scheduler_output, token_mask)
            except EngineDeadError:
                raise
            except Exception as exc:
                result = RunnerOutput(error=exc)
        updated = self.scheduler.update_from_output(scheduler_output, result)
        processed = self.output_processor.process(scheduler_output, updated, result)
        self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(processed.aborted, RequestStatus.FINISHED_ABORTED)
        return processed.outputs

    def take_failures(self) -> dict[str, BaseException]:
        """Requests that failed (and were aborted) since the last call: id -> error."""
        return self.output_processor.take_failures()

    # ------------------------------------------------------------------ requests

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's generation-config defaults applied."""
        return self.loaded.sampling_defaults.sampling_params()

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError(
                "prompt",
                f"a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                f"'prompt_token_ids'; got {type(prompt).__name__}",
            )
        if token_ids is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt", "the tokenizer is disabled (--skip-tokenizer-init): give token ids"
                )
            token_ids = self.tokenizer.encode(text)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt",
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
            )
        return text, token_ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> None:
        self.add_requests(
            [NewRequest(request_id, prompt, params, priority, arrival_time, lora_request)]
        )

    def add_requests(self, requests: Sequence[NewRequest]) -> None:
        """Queue several requests at once: every one is validated first, so an invalid
        one (:class:`InvalidRequestError`) queues none of them."""
        ids = [r.request_id for r in requests]
        live = self.output_processor.requests
        taken = sorted({i for i in ids if i in live or ids.count(i) > 1})
        if taken:
            raise InvalidRequestError("request_id", f"request id {taken[0]!r} is already in use")
        parents = [self._new_parent(r) for r in requests]
        for parent in parents:
            self.output_processor.add(parent)
            for seq in parent.sequences:
                self.scheduler.add_request(seq.request)

    def _new_parent(self, new: NewRequest) -> ParentRequest:
        """The request's state, validated; nothing is queued yet."""
        params, priority = new.params, new.priority
        if isinstance(params, PoolingParams) or self.is_pooling:
            return self._new_pooling_parent(new)
        text, token_ids = self._prompt_tokens(new, params.truncate_prompt_tokens)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt ({len(token_ids)} tokens) leaves no room for output within the "
                f"maximum model length of {self.max_model_len} tokens",
            )
        if params.prompt_logprobs is not None or params.logprobs is not None:
            limit = self.config.model_config.max_logprobs
            asked = max(params.logprobs or 0, params.prompt_logprobs or 0)
            if limit != -1 and asked > limit:
                raise InvalidRequestError(
                    "logprobs" if (params.logprobs or 0) >= asked else "prompt_logprobs",
                    f"requested {asked} logprobs; the limit is --max-logprobs={limit}",
                )
        guided, compiled = self._submit_guided(params)
        if compiled is not None and compiled.done():
            if compiled.cancelled():
                raise EngineDeadError("compiling the request's constraint was stopped")
            if compiled.exception() is not None:
                raise InvalidRequestError("guided_decoding", str(compiled.exception()))
        params = params.clone()
        params.guided_decoding = guided
        params.update_from_tokenizer(self.loaded.eos_token_ids, self.tokenizer, self.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        # The generation config's max_new_tokens caps every request, however it came.
        params.max_tokens = self.loaded.sampling_defaults.cap(params.max_tokens)
        now = time.monotonic() if new.arrival_time is None else new.arrival_time
        parent = ParentRequest(
            request_id=new.request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            sequences=[],
            metrics=RequestMetrics(arrival_time=now),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        features: dict[str, Any] = {}
        if compiled is not None:
            features["guided"] = compiled
        if new.lora_request is not None:
            features["lora"] = new.lora_request
        count = params.num_sequences
        for index in range(count):
            child_params = params
            if count > 1:
                child_params = params.clone()
                if params.seed is not None:
                    child_params.seed = params.seed + index
            if index > 0:
                # Only the first sequence computes prompt logprobs.
                child_params.prompt_logprobs = None
            request = Request(
                request_id=new.request_id if count == 1 else f"{index}_{new.request_id}",
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_id=self.loaded.eos_token_ids[0] if self.loaded.eos_token_ids else None,
                arrival_time=now,
                priority=priority,
                parent_id=new.request_id,
                sequence_index=index,
                features=dict(features),
            )
            self._prepare_features(request)
            parent.sequences.append(self.output_processor.new_sequence(request, index))
        return parent

    def _prompt_tokens(self, new: NewRequest, keep: int | None) -> tuple[str | None, list[int]]:
        """The request's prompt tokenized, cut to its last ``keep`` tokens; a priority the
        scheduling policy ignores, or an empty prompt, is refused."""
        if new.priority != 0 and self.config.scheduler_config.policy != "priority":
            raise InvalidRequestError(
                "priority", "priority is only used with --scheduling-policy priority"
            )
        text, token_ids = self.tokenize_prompt(new.prompt)
        if keep is not None:
            token_ids = token_ids[-keep:]
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return text, token_ids

    def _prepare_features(self, request: Request) -> None:
        """The step extensions' look at a new request: each feature it asks for must be
        on; they validate it and attach their state (e.g. load its LoRA adapter)."""
        for name in request.features:
            if name not in self.extensions:
                raise self.pm.registry("step_extensions").load(name).not_enabled_error()
        for extension in self._new_request_hooks:
            extension.new_request(request)

    def _new_pooling_parent(self, new: NewRequest) -> ParentRequest:
        """A pooling request's state, validated: its prompt runs once, whole."""
        params = new.params
        if not self.is_pooling:
            raise InvalidRequestError(
                "task",
                f"this model serves --task {self.task}; pooling requests (embeddings, "
                "classification, scores, rewards) need an engine started with --task "
                f"{'/'.join(POOLING_TASKS)}",
            )
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                "task",
                f"this model serves --task {self.task} (pooling), not text generation",
            )
        params = params.clone()
        params.task = params.task or self.task
        if params.task not in self.pooler_configs:
            raise InvalidRequestError(
                "task",
                f"this model serves {', '.join(self.pooler_configs)}, not {params.task}",
            )
        try:
            params.verify(params.task, self.loaded.hf_config)
        except ValueError as exc:
            raise InvalidRequestError("pooling_params", str(exc)) from None
        text, token_ids = self._prompt_tokens(new, params.truncate_prompt_tokens)
        if params.truncate_prompt_tokens is not None and params.token_type_ids is not None:
            params.token_type_ids = params.token_type_ids[-params.truncate_prompt_tokens :]
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt ({len(token_ids)} tokens) is longer than the maximum model length "
                f"of {self.max_model_len} tokens",
            )
        if params.token_type_ids is not None and len(params.token_type_ids) != len(token_ids):
            raise InvalidRequestError("token_type_ids", "one token type per prompt token")
        now = time.monotonic() if new.arrival_time is None else new.arrival_time
        placeholder = SamplingParams(max_tokens=1, detokenize=False)
        parent = ParentRequest(
            request_id=new.request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=placeholder,
            sequences=[],
            metrics=RequestMetrics(arrival_time=now),
        )
        request = Request(
            request_id=new.request_id,
            prompt_token_ids=token_ids,
            sampling_params=placeholder,
            arrival_time=now,
            priority=new.priority,
            features={"pooling": params},
        )
        self._prepare_features(request)
        parent.sequences.append(self.output_processor.new_sequence(request, 0))
        return parent

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now; their KV blocks are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            parent = self.output_processor.pop(request_id)
            if parent is not None:
                self.scheduler.finish_requests(parent.sequence_ids, RequestStatus.FINISHED_ABORTED)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def shutdown(self) -> None:
        """Abort what is unfinished (its KV blocks come back), stop the guided-decoding
        compiles (their worker processes and threads exit) and drop the KV cache. The
        engine takes no request afterwards."""
        self.abort_request(self.unfinished_request_ids())
        if self.guided is not None:
            self.guided.shutdown()
        self._stop_executor()
        gc.unfreeze()  # (so that collecting the engine's cycles can free it)

    # ------------------------------------------------------------ guided decoding

    def check_guided(self, params: SamplingParams) -> None:
        """Compile the request's constraint now (cached): ``ValueError`` names what is
        wrong with it. Entry points call this before ``add_request`` (the server in a
        worker thread) so that a bad schema is refused up front."""
        _, compiled = self._submit_guided(params)
        if compiled is not None:
            compiled.result()

    def _submit_guided(self, params: SamplingParams) -> tuple[Any, Any]:
        """``(GuidedDecodingParams, future of its compiled constraint)``, or ``(None,
        None)`` for an unconstrained request."""
        guided = as_guided_params(params.guided_decoding)
        if guided is None:
            return None, None
        if self.guided is None:
            raise InvalidRequestError(
                "guided_decoding", "guided decoding needs the tokenizer (--skip-tokenizer-init)"
            )
        return guided, self.guided.submit(guided)


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
