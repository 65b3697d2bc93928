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
from pagedllm.core.config import scheduler_class
from pagedllm.core.errors import (
    ConfigError,
    EngineDeadError,
    EngineSleepingError,
    InvalidRequestError,
)
from pagedllm.core.interfaces.executor import Executor, executor_class
from pagedllm.core.interfaces.extension import StepExtension, overriding
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.model_setup import num_kv_blocks, resolve_task
from pagedllm.core.output_processor import OutputProcessor, ParentRequest
from pagedllm.core.outputs import RequestMetrics, RequestOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner import ModelRunner
from pagedllm.core.sampling import SamplingParams
from pagedllm.core.sleep_mode import SleepMode
from pagedllm.core.stats import StatLogger
from pagedllm.core.step_data import RunnerOutput
from pagedllm.core.step_extensions import build_step_extensions
from pagedllm.core.virtual_engines import StepQueue, VirtualEngines

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.step_data import SchedulerOutput
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
    # The step extensions' request keywords given, by keyword (see
    # StepExtension.request_arg).
    extension_args: dict[str, Any] = dataclasses.field(default_factory=dict)


class LLMEngine(SleepMode):
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
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.text_config.vocab_size
        self.attention_backend_cls = backend_cls
        mc = config.model_config
        self.task = resolve_task(mc.task, loaded.model, mc.runner, mc.convert)
        # The step extensions the configuration turns on (pagedllm's features, a
        # plugin's), by name; each may change the configuration (the validated one is
        # frozen: the engine runs with a copy) and take memory before the KV cache is
        # sized from what is left.
        self.extensions = {e.name: e for e in build_step_extensions(self)}
        extensions = list(self.extensions.values())
        # The request tasks served beside generation (each an extension's).
        self.served_tasks = tuple(task for e in extensions for task in e.tasks)
        for extension in extensions:
            self.config = extension.adjust_config(self.config)
        config, cache = self.config, self.config.cache_config
        # (every rank holds num_blocks blocks of its KV cache)
        layout, bytes_per_block = self.executor.kv_cache_layout(loaded)
        device = config.device_config.device
        check_batch_invariance(config, backend_cls(), loaded.model, layout.dtype)
        # Decode steps replayed from graphs: on a device that captures them, unless
        # --enforce-eager (then capture_sizes is empty), with one rank and no extension
        # that changes what a step computes.
        use_graphs = (
            device.captures_graphs
            and bool(config.compilation_config.capture_sizes)
            and all(e.allows_decode_graphs for e in extensions)
            and self.executor.num_ranks == 1
        )
        bytes_per_block += sum(e.kv_bytes_per_block(cache.block_size) for e in extensions)
        if cache.num_gpu_blocks_override is None:
            sched = config.scheduler_config

            def profile() -> int:
                # (the extensions' parts made only where the device profiles)
                parts = {e.name: p for e in extensions if (p := e.profile_payload()) is not None}
                return self.executor.profile(
                    layout,
                    block_size=cache.block_size,
                    num_tokens=sched.max_num_batched_tokens,
                    num_seqs=sched.max_num_seqs,
                    max_model_len=self.max_model_len,
                    extensions=parts,
                )

            device.measure_peak_memory(profile)
        # Memory the extensions will hold beside the KV cache (e.g. encoder outputs).
        reserved_bytes = {e.name: n for e in extensions if (n := e.reserved_bytes()) > 0}
        for name, size in reserved_bytes.items():
            logger.info("KV cache budget: %.1f MiB kept for %s", size / 2**20, name)
        num_blocks = num_kv_blocks(
            config,
            bytes_per_block,
            self.max_model_len,
            reserved=int(use_graphs),
            reserved_bytes=sum(reserved_bytes.values()),
        )
        self.kv_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        # Each rank's runner gets the extensions' runner sides, by name.
        runner_sides = {e.name: p for e in extensions if (p := e.runner_payload()) is not None}
        self.executor.init_cache(layout, num_blocks, extensions=runner_sides, graphs=use_graphs)
        for extension in extensions:
            extension.kv_cache_ready(self, num_blocks)
        self._hooks = {
            hook: overriding(extensions, StepExtension, hook)
            for hook in (
                "check_params",
                "new_parent",
                "new_request",
                "process_prompt",
                "prepare_prompt",
                "step_done",
            )
        }
        # Which extension reads each key of a prompt dict beside the prompt itself.
        self._prompt_keys = {key: e for e in extensions for key in e.prompt_keys}
        # Which extension each request keyword belongs to.
        self._request_args = {e.request_arg: e for e in extensions if e.request_arg}
        stateful = overriding(extensions, StepExtension, "request_state")
        self._states = [e for e in extensions if e.request_arg or e in stateful]
        sched = config.scheduler_config
        # Steps in flight (pipeline stages): one virtual engine, with its own scheduler
        # and requests, per step the executor can have in flight.
        in_flight = self.executor.steps_in_flight
        holding = [e.name for e in extensions if not e.allows_steps_in_flight]
        if in_flight > 1 and holding:
            logger.info(
                "one step at a time (not %d in flight): the step extensions %s do not allow more",
                in_flight,
                holding,
            )
            in_flight = 1
        schedulers = [
            scheduler_class(sched.scheduler_cls, pm)(
                sched, self.kv_manager, self.max_model_len, extensions=extensions
            )
            for _ in range(in_flight)
        ]
        self.scheduler: Any = schedulers[0]
        self.step_queue: StepQueue | None = None
        if in_flight > 1:
            self.scheduler = VirtualEngines(schedulers)
            self.step_queue = StepQueue(self.scheduler, self.executor, self._finish_step)
            logger.info("%d virtual engines: up to %d steps in flight", in_flight, in_flight)
        self.stat_logger = StatLogger(
            self, enabled=not config.observability_config.disable_log_stats
        )
        self.output_processor = OutputProcessor(self.tokenizer, pm, self.stat_logger)
        self._ids = itertools.count()
        # Sleep mode: the level asleep at (0: awake), what is still asleep (vLLM's wake
        # tags) and whether new requests are refused (asleep, or falling asleep once the
        # running ones finish).
        self.sleep_level = 0
        self.sleeping_tags: set[str] = set()
        self.refusing_requests = False
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            num_blocks * layout.bytes_per_block(cache.block_size) / 2**30,
            str(layout.dtype).removeprefix("torch."),
        )
        pm.hook.pagedllm_engine_started(engine=self)
        config.device_config.device.release_startup_memory()
        # Everything built so far (modules, weights' wrappers, plugins, the tokenizer)
        # lives as long as the engine: out of the cyclic collector's way, which otherwise
        # walks it again at every full collection (3-4% of a batched decode step's time,
        # measured on the default model at 64 sequences). shutdown() gives it back, and so
        # does the interpreter's exit (whose last collections free what is still alive).
        gc.freeze()
        _unfreeze_at_exit()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One step. A failure while computing it fails only the requests it scheduled
        (see :meth:`take_failures`); the engine goes on with the others. With steps in
        flight (:mod:`pagedllm.core.virtual_engines`): the virtual engines with none in
        flight start one, and the oldest step in flight ends."""
        if self.step_queue is not None:
            return self.step_queue.step()
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
        return self._finish_step(self.scheduler, scheduler_output, result)

    def _finish_step(
        self, scheduler: Any, scheduler_output: SchedulerOutput, result: RunnerOutput
    ) -> list[RequestOutput]:
        """A step's end: ``scheduler`` (its virtual engine's) advances its requests,
        outputs are made, and the requests stopped by text or aborted are finished."""
        updated = scheduler.update_from_output(scheduler_output, result)
        processed = self.output_processor.process(scheduler_output, updated, result)
        self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(processed.aborted, RequestStatus.FINISHED_ABORTED)
        for extension in self._hooks["step_done"]:
            extension.step_done()
        return processed.outputs

    def drain_steps(self) -> list[RequestOutput]:
        """Finish the steps in flight (none without virtual engines)."""
        return [] if self.step_queue is None else self.step_queue.drain()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (the blocks stay, their hashes go). Refused (False,
        nothing changed) while a request holds blocks."""
        done = self.kv_manager.reset_prefix_cache()
        for extension in self._hooks["step_done"]:
            extension.step_done()
        return done

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
        params: Any,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        **extension_args: Any,
    ) -> None:
        """Queue a request. ``params``: ``SamplingParams``, or the parameters a step
        extension serves (its ``params_type``); ``extension_args``: the step extensions'
        request keywords (their ``request_arg``)."""
        self.add_requests(
            [NewRequest(request_id, prompt, params, priority, arrival_time, extension_args)]
        )

    def add_requests(self, requests: Sequence[NewRequest]) -> None:
        """Queue several requests at once: every one is validated first, so an invalid
        one (:class:`InvalidRequestError`) queues none of them."""
        if self.refusing_requests:
            raise EngineSleepingError(
                "the engine is sleeping (or falling asleep): wake it up first with "
                "POST /wake_up (LLM.wake_up() offline)"
            )
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

    def check_params(self, params: Any) -> None:
        """The step extensions' up-front checks of a request's parameters (e.g. a
        constraint compiled now, cached): ``ValueError`` or
        :class:`InvalidRequestError` names what is wrong. Entry points call this before
        ``add_request`` (the server in a worker thread)."""
        for extension in self._hooks["check_params"]:
            extension.check_params(params)

    def needs_preparing(self, prompt: PromptType) -> bool:
        """Whether :meth:`prepare_prompt` would do anything for ``prompt`` (it has a key
        that a step extension prepares)."""
        return isinstance(prompt, dict) and any(
            prompt.get(key) is not None
            for extension in self._hooks["prepare_prompt"]
            for key in extension.prompt_keys
        )

    def prepare_prompt(self, prompt: PromptType, params: Any) -> PromptType:
        """``prompt`` with the step extensions' heavy per-prompt work done
        (:meth:`StepExtension.prepare_prompt`: e.g. its images preprocessed), in a form
        :meth:`add_requests` takes without doing it again; ``prompt`` itself where there
        is nothing to do. Safe on any thread, beside the steps (it reads only what is
        fixed once the engine is built): the server calls it on a worker thread, so that a
        large image's preprocessing holds up no running request. Raises
        :class:`InvalidRequestError` as :meth:`add_requests` would."""
        if not self.needs_preparing(prompt) or not isinstance(params, SamplingParams):
            return prompt
        assert isinstance(prompt, dict)
        _, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        for extension in self._hooks["prepare_prompt"]:
            if any(prompt.get(key) is not None for key in extension.prompt_keys):
                prepared = extension.prepare_prompt(prompt, token_ids, params)
                if prepared is not None:
                    prompt = prepared
                    token_ids = list(prompt.get("prompt_token_ids", token_ids))
        return prompt

    def _new_parent(self, new: NewRequest) -> ParentRequest:
        """The request's state, validated; nothing is queued yet."""
        unknown = sorted(
            k
            for k, v in new.extension_args.items()
            if v is not None and k not in self._request_args
        )
        if unknown:
            raise self._extension_off(unknown[0], "request_arg")
        if isinstance(new.prompt, dict):
            self._check_prompt_keys(new.prompt)
        for extension in self._hooks["new_parent"]:
            parent = extension.new_parent(self, new)
            if parent is not None:
                return parent
        params = new.params
        if not isinstance(params, SamplingParams):
            raise self._extension_off(type(params), "params_type")
        text, token_ids = self.prompt_tokens(new, params.truncate_prompt_tokens)
        features: dict[str, Any] = {}
        expanded = False
        if self._hooks["process_prompt"]:
            prompt = new.prompt if isinstance(new.prompt, dict) else {}
            for extension in self._hooks["process_prompt"]:
                processed = extension.process_prompt(prompt, token_ids, params)
                if processed is not None:
                    expanded = True
                    token_ids, features[extension.name] = processed
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt ({len(token_ids)} tokens) leaves no room for output within the "
                f"maximum model length of {self.max_model_len} tokens",
            )
        if expanded and params.max_tokens is not None:
            # (the caller could not count a prompt that processing made: e.g. one whose
            # images' placeholders were expanded; the server refuses a text prompt so)
            total = len(token_ids) + params.max_tokens
            if total > self.max_model_len:
                raise InvalidRequestError(
                    "max_tokens",
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {total} tokens ({len(token_ids)} in the "
                    f"messages, {params.max_tokens} in the completion). Please reduce the "
                    f"length of the messages or completion.",
                )
        if params.prompt_logprobs is not None or params.logprobs is not None:
            limit = self.config.model_config.max_logprobs
            asked = max(params.logprobs or 0, params.prompt_logprobs or 0)
            if limit != -1 and asked > limit:
                raise InvalidRequestError(
                    "logprobs" if (params.logprobs or 0) >= asked else "prompt_logprobs",
                    f"requested {asked} logprobs; the limit is --max-logprobs={limit}",
                )
        params = params.clone()
        for extension in self._states:
            given = new.extension_args.get(extension.request_arg) if extension.request_arg else None
            state = extension.request_state(params, given)
            if state is not None:
                features[extension.name] = state
        params.update_from_tokenizer(self.loaded.eos_token_ids, self.tokenizer, self.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        # The generation config's max_new_tokens caps every request, however it came.
        params.max_tokens = self.loaded.sampling_defaults.cap(params.max_tokens)
        return self.build_parent(new, text, token_ids, params, features)

    def _check_prompt_keys(self, prompt: dict[str, Any]) -> None:
        """A prompt dict's keys that a step extension reads (``prompt_keys``) are refused
        where that extension is off (its own error)."""
        extra = [k for k in prompt if k not in ("prompt", "prompt_token_ids")]
        off = [k for k in extra if k not in self._prompt_keys and prompt[k] is not None]
        if not off:
            return
        registry = self.pm.registry("step_extensions")
        for entry in registry:
            cls = registry.load(entry.name)
            if any(key in getattr(cls, "prompt_keys", ()) for key in off):
                raise cls.not_enabled_error()

    def _extension_off(self, key: Any, attribute: str) -> InvalidRequestError:
        """The error for a request keyword (or a kind of parameters) of a step extension
        this engine does not run: the extension's own, else one naming ``key``."""
        registry = self.pm.registry("step_extensions")
        for entry in registry:
            cls = registry.load(entry.name)
            if getattr(cls, attribute, None) == key:
                return cls.not_enabled_error()
        if attribute == "request_arg":
            return InvalidRequestError(key, f"no step extension takes {key!r}")
        return InvalidRequestError(
            "params", f"requests take SamplingParams here, not {key.__name__}"
        )

    def prompt_tokens(self, new: NewRequest, keep: int | None) -> tuple[str | None, list[int]]:
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

    def build_parent(
        self,
        new: NewRequest,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        features: dict[str, Any],
        *,
        samples_tokens: bool = True,
    ) -> ParentRequest:
        """A validated request's state: its ``params.n`` sequences (each carrying the
        step extensions' ``features``), seen by the extensions' ``new_request``."""
        now = time.monotonic() if new.arrival_time is None else new.arrival_time
        parent = ParentRequest(
            request_id=new.request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            sequences=[],
            metrics=RequestMetrics(arrival_time=now, n=params.n, max_tokens=params.max_tokens),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        eos = self.loaded.eos_token_ids[0] if self.loaded.eos_token_ids else None
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
                eos_token_id=eos if samples_tokens else None,
                arrival_time=now,
                priority=new.priority,
                parent_id=new.request_id,
                sequence_index=index,
                features=dict(features),
                samples_tokens=samples_tokens,
            )
            for name in request.features:
                if name not in self.extensions:
                    raise self.pm.registry("step_extensions").load(name).not_enabled_error()
            for extension in self._hooks["new_request"]:
                extension.new_request(request)
            parent.sequences.append(self.output_processor.new_sequence(request, index))
        return parent

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now; their KV blocks are freed. Returns the last outputs of those
        that were unfinished (finish reason "abort"), for whoever accounts for every
        request (traces)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = []
        for request_id in ids:
            parent = self.output_processor.pop(request_id)
            if parent is not None:
                self.scheduler.finish_requests(parent.sequence_ids, RequestStatus.FINISHED_ABORTED)
                aborted.append(self.output_processor.aborted_output(parent))
        return aborted

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished, or a step still in flight (its requests
        aborted meanwhile): either way :meth:`step` has work."""
        return bool(self.output_processor.requests) or bool(self.step_queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def shutdown(self) -> None:
        """Abort what is unfinished (its KV blocks come back), stop the step extensions
        (their worker processes and threads) and drop the KV cache. The engine takes no
        request afterwards."""
        self.abort_request(self.unfinished_request_ids())
        try:
            self.drain_steps()  # (the ranks computing them stop next)
        except Exception:  # (a rank died: nothing is left to wait for)
            logger.debug("steps in flight lost at shutdown", exc_info=True)
        for extension in self.extensions.values():
            extension.shutdown()
        self._stop_executor()
        gc.unfreeze()  # (so that collecting the engine's cycles can free it)


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
