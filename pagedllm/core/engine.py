"""``LLMEngine``: requests in, ``RequestOutput``s out, one scheduler step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.guided import GuidedDecodingManager
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.model_setup import load_model, num_kv_blocks
from pagedllm.core.output_processor import OutputProcessor, ParentRequest
from pagedllm.core.outputs import RequestMetrics, RequestOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner import ModelRunner, kv_cache_spec
from pagedllm.core.sampling import SamplingParams
from pagedllm.core.sampling.guided_params import as_guided_params
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.stats import StatLogger

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.inputs import PromptType

logger = logging.getLogger("pagedllm.engine")


class LLMEngine:
    def __init__(self, config: PagedLLMConfig, pm: PluginManager) -> None:
        import torch

        self.config = config
        self.pm = pm
        if config.model_config.seed is not None:
            torch.manual_seed(config.model_config.seed)
        loaded = load_model(config, pm)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        sched = config.scheduler_config
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens={sched.max_num_batched_tokens} is smaller than "
                f"--max-model-len={self.max_model_len}: a long prompt could never be scheduled "
                f"without --enable-chunked-prefill"
            )
        if sched.preemption_mode == "swap":
            raise ConfigError(
                "--preemption-mode swap is not supported: pagedllm preempts by recomputation "
                "(on the cpu the KV cache already lives in host memory, so swapping would only "
                "copy it); leave --preemption-mode unset or use recompute"
            )
        cache = config.cache_config
        spec = kv_cache_spec(loaded.hf_config, loaded.dtype)
        num_blocks = num_kv_blocks(
            config, spec.bytes_per_block(cache.block_size), self.max_model_len
        )
        self.kv_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.scheduler = _scheduler_class(sched.scheduler_cls)(
            sched, self.kv_manager, self.max_model_len
        )
        self.vocab_size = loaded.hf_config.vocab_size
        backend_cls = pm.load("attention_backends", config.device_config.device.attention_backend)
        self.runner = ModelRunner(
            loaded.model,
            spec,
            num_blocks,
            cache.block_size,
            self.vocab_size,
            config.device_config.torch_device,
            backend_cls(),
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
        self.runner.guided = self.guided
        # Requests whose constraint is compiling: engine request id -> request.
        self._compiling: dict[str, Request] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parents: dict[str, ParentRequest] = {}
        # engine request id -> (parent, sequence index)
        self.sequences: dict[str, tuple[ParentRequest, int]] = {}
        self.stat_logger = StatLogger(
            self, enabled=not config.observability_config.disable_log_stats
        )
        self._ids = itertools.count()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            num_blocks * spec.bytes_per_block(cache.block_size) / 2**30,
        )
        pm.hook.pagedllm_engine_started(engine=self)

    # ------------------------------------------------------------------ requests

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's generation-config defaults applied."""
        return SamplingParams(**self.loaded.generation_defaults)

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
            raise ValueError(
                f"a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                f"'prompt_token_ids'; got {type(prompt).__name__}"
            )
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError(
                    "the tokenizer is disabled (--skip-tokenizer-init): give token ids"
                )
            token_ids = self.tokenizer.encode(text)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
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
    ) -> None:
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError("priority is only used with --scheduling-policy priority")
        text, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) leaves no room for output within the "
                f"maximum model length of {self.max_model_len} tokens"
            )
        if params.prompt_logprobs is not None or params.logprobs is not None:
            limit = self.config.model_config.max_logprobs
            asked = max(params.logprobs or 0, params.prompt_logprobs or 0)
            if limit != -1 and asked > limit:
                raise ValueError(f"requested {asked} logprobs; the limit is --max-logprobs={limit}")
        guided, compiled = self._submit_guided(params)
        if compiled is not None and compiled.done() and compiled.exception() is not None:
            raise ValueError(str(compiled.exception()))
        params = params.clone()
        params.guided_decoding = guided
        params.update_from_tokenizer(self.loaded.eos_token_ids, self.tokenizer, self.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        parent = ParentRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            sequences=[],
            metrics=RequestMetrics(arrival_time=now),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        count = params.num_sequences
        for index in range(count):
            child_params = params
            if count > 1:
                child_params = params.clone()
                if params.seed is not None:
                    child_params.seed = params.seed + index
            child_id = request_id if count == 1 else f"{index}_{request_id}"
            if index > 0:
                # Only the first sequence computes prompt logprobs.
                child_params.prompt_logprobs = None
            request = Request(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_id=self.loaded.eos_token_ids[0] if self.loaded.eos_token_ids else None,
                arrival_time=now,
                priority=priority,
            )
            if compiled is not None:
                request.pending = compiled
                self._compiling[child_id] = request
            parent.sequences.append(self.output_processor.new_sequence(request, index))
            self.sequences[child_id] = (parent, index)
        self.parents[request_id] = parent
        for seq in parent.sequences:
            self.scheduler.add_request(seq.request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now; their KV blocks are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            child_ids = [s.request.request_id for s in parent.sequences]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for child_id in child_ids:
                self.sequences.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---------------------------------------------------------------------- step

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
            raise ValueError("guided decoding needs the tokenizer (--skip-tokenizer-init)")
        return guided, self.guided.submit(guided)

    def _fail_uncompiled(self) -> list[RequestOutput]:
        """Finish (as aborted) the requests whose constraint failed to compile."""
        outputs = []
        for child_id, request in list(self._compiling.items()):
            if not request.pending.done():
                continue
            del self._compiling[child_id]
            error = request.pending.exception()
            entry = self.sequences.get(child_id)
            if error is None or entry is None:
                continue
            parent, _ = entry
            logger.error("request %s: guided decoding failed: %s", parent.request_id, error)
            child_ids = [seq.request.request_id for seq in parent.sequences]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for seq in parent.sequences:
                self._compiling.pop(seq.request.request_id, None)
                self.output_processor.finish(seq, "abort", None)
            output = self.output_processor.make_output(parent)
            if output is not None:
                outputs.append(output)
            self._forget(parent)
        return outputs

    def step(self) -> list[RequestOutput]:
        failed = self._fail_uncompiled() if self._compiling else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return failed
        now = time.monotonic()
        for item in scheduler_output.scheduled:
            parent, _ = self.sequences[item.request.request_id]
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
        result = self.runner.execute(scheduler_output, self.kv_manager)
        for item in scheduler_output.scheduled:
            rows = result.prompt_logprobs.get(item.request.request_id)
            if rows:
                parent, _ = self.sequences[item.request.request_id]
                self._record_prompt_logprobs(parent, item.num_computed_tokens + 1, rows)
        updated = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        self.stat_logger.on_step(scheduler_output, len(updated))
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for request in updated:
            parent, index = self.sequences[request.request_id]
            seq = parent.sequences[index]
            token = request.output_token_ids[-1]
            broken = (
                self.guided is not None
                and not request.is_finished
                and not self.guided.accept(request, token)
            )
            stop = self.output_processor.on_token(
                seq, token, result.logprobs.get(request.request_id)
            )
            if broken and stop is None:
                # Only when a ban overrode the mask (e.g. min_tokens against a finished
                # constraint): end the output rather than leave the constraint.
                logger.warning(
                    "request %s: token %d breaks its guided-decoding constraint; stopping it",
                    request.request_id,
                    token,
                )
                stop = token
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.num_cached_tokens = max(request.num_cached_tokens, 0)
            parent.metrics.last_token_time = now
            parent.metrics.num_generation_tokens = max(
                parent.metrics.num_generation_tokens, request.num_output_tokens
            )
            if stop is not None:
                stopped.append(request.request_id)
                self.output_processor.finish(seq, "stop", stop)
            elif request.is_finished:
                self.output_processor.finish(seq, request.status.finish_reason, request.stop_reason)
            touched[parent.request_id] = parent
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = failed
        for parent in touched.values():
            parent.metrics.num_preemptions = sum(
                s.request.num_preemptions for s in parent.sequences
            )
            output = self.output_processor.make_output(parent)
            if output is not None:
                outputs.append(output)
            if parent.finished:
                self._forget(parent)
                self.pm.hook.pagedllm_request_finished(request_output=output)
        return outputs

    def _record_prompt_logprobs(self, parent: ParentRequest, first: int, rows: list[Any]) -> None:
        """Rows for prompt positions ``first, first + 1, ...``; positions already recorded
        (a preempted request recomputes its prompt) are skipped."""
        recorded = parent.prompt_logprobs
        for position, row in enumerate(rows, start=first):
            if position == len(recorded):
                recorded.append(self.output_processor.position_logprobs(row))

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.sequences:
            self.sequences.pop(seq.request.request_id, None)
            self._compiling.pop(seq.request.request_id, None)


DEFAULT_SCHEDULER = "pagedllm.core.scheduler.Scheduler"
# vLLM's names for its default scheduler mean ours.
_SCHEDULER_ALIASES = ("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler")


def _scheduler_class(path: str | None) -> type[Scheduler]:
    """``--scheduler-cls``: a dotted path to a Scheduler subclass."""
    if path in (None, DEFAULT_SCHEDULER, *_SCHEDULER_ALIASES):
        return Scheduler
    import importlib

    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--scheduler-cls {path}: cannot import it: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigError(
            f"--scheduler-cls {path}: not a subclass of pagedllm.core.scheduler.Scheduler"
        )
    return cls
