"""``LLMEngine``: requests in, ``RequestOutput``s out, one scheduler step at a time."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.config import scheduler_class
from pagedllm.core.errors import EngineDeadError
from pagedllm.core.guided import GuidedDecodingManager
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.model_setup import load_model, num_kv_blocks
from pagedllm.core.output_processor import OutputProcessor, ParentRequest
from pagedllm.core.outputs import RequestMetrics, RequestOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner import ModelRunner, kv_cache_spec
from pagedllm.core.sampling import SamplingParams
from pagedllm.core.sampling.guided_params import as_guided_params
from pagedllm.core.stats import StatLogger

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
        self.scheduler = scheduler_class(sched.scheduler_cls)(
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
        # Requests a step failed on, until the caller takes them (take_failures).
        self.failed: dict[str, Exception] = {}
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
        self.add_requests([NewRequest(request_id, prompt, params, priority, arrival_time)])

    def add_requests(self, requests: Sequence[NewRequest]) -> None:
        """Queue several requests at once: every one is validated first, so an invalid
        one (``ValueError``) queues none of them."""
        ids = [r.request_id for r in requests]
        taken = sorted({i for i in ids if i in self.parents or ids.count(i) > 1})
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        parents = [self._new_parent(r) for r in requests]
        for parent, compiled in parents:
            self._enqueue(parent, compiled)

    def _new_parent(self, new: NewRequest) -> tuple[ParentRequest, Any]:
        """The request's state, validated; nothing is queued yet."""
        params, priority = new.params, new.priority
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError("priority is only used with --scheduling-policy priority")
        text, token_ids = self.tokenize_prompt(new.prompt)
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
        if compiled is not None and compiled.done():
            if compiled.cancelled():
                raise EngineDeadError("compiling the request's constraint was stopped")
            if compiled.exception() is not None:
                raise ValueError(str(compiled.exception()))
        params = params.clone()
        params.guided_decoding = guided
        params.update_from_tokenizer(self.loaded.eos_token_ids, self.tokenizer, self.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
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
        count = params.num_sequences
        for index in range(count):
            child_params = params
            if count > 1:
                child_params = params.clone()
                if params.seed is not None:
                    child_params.seed = params.seed + index
            child_id = new.request_id if count == 1 else f"{index}_{new.request_id}"
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
            parent.sequences.append(self.output_processor.new_sequence(request, index))
        return parent, compiled

    def _enqueue(self, parent: ParentRequest, compiled: Any) -> None:
        for index, seq in enumerate(parent.sequences):
            child_id = seq.request.request_id
            if compiled is not None:
                seq.request.pending = compiled
                self._compiling[child_id] = seq.request
            self.sequences[child_id] = (parent, index)
        self.parents[parent.request_id] = parent
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
            pending = request.pending
            error = (
                RuntimeError("compiling its constraint was stopped")
                if pending.cancelled()
                else pending.exception()
            )
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
        """One scheduler step. A failure while computing it fails only the requests it
        scheduled (see :meth:`take_failures`); the engine goes on with the others."""
        failed = self._fail_uncompiled() if self._compiling else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return failed
        scheduled = {}
        for item in scheduler_output.scheduled:
            parent, _ = self.sequences[item.request.request_id]
            scheduled[parent.request_id] = parent
        try:
            updated, result = self._execute(scheduler_output)
        except Exception as exc:
            self._fail(list(scheduled.values()), exc)
            return failed
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for request in updated:
            entry = self.sequences.get(request.request_id)
            if entry is None:  # a sibling sequence failed earlier in this loop
                continue
            parent, index = entry
            try:
                stop = self._on_token(request, parent, parent.sequences[index], result, now)
            except Exception as exc:
                touched.pop(parent.request_id, None)
                self._fail([parent], exc)
                continue
            if stop:
                stopped.append(request.request_id)
            touched[parent.request_id] = parent
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = failed
        for parent in touched.values():
            try:
                output = self._make_output(parent)
            except Exception as exc:
                self._fail([parent], exc)
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _execute(self, scheduler_output: Any) -> tuple[list[Request], Any]:
        """Run the model on the scheduled batch and advance the scheduler."""
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
        try:
            self.stat_logger.on_step(scheduler_output, len(updated))
        except Exception:  # statistics must never cost a request
            logger.exception("the stat logger failed")
        return updated, result

    def _on_token(
        self, request: Request, parent: ParentRequest, seq: Any, result: Any, now: float
    ) -> bool:
        """Take a sequence's new token: guided decoding, detokenizing, stop strings.
        True when it stopped on a stop string (the scheduler finishes it)."""
        token = request.output_token_ids[-1]
        broken = (
            self.guided is not None
            and not request.is_finished
            and not self.guided.accept(request, token)
        )
        stop = self.output_processor.on_token(seq, token, result.logprobs.get(request.request_id))
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
            self.output_processor.finish(seq, "stop", stop)
            return True
        if request.is_finished:
            self.output_processor.finish(seq, request.status.finish_reason, request.stop_reason)
        return False

    def _make_output(self, parent: ParentRequest) -> RequestOutput | None:
        parent.metrics.num_preemptions = sum(s.request.num_preemptions for s in parent.sequences)
        output = self.output_processor.make_output(parent)
        if parent.finished:
            self._forget(parent)
            try:
                self.pm.hook.pagedllm_request_finished(request_output=output)
            except Exception:  # a plugin's bug must not cost the request its output
                logger.exception("a pagedllm_request_finished hook failed")
        return output

    def _fail(self, parents: list[ParentRequest], exc: Exception) -> None:
        """Abort ``parents`` after an unexpected error; :meth:`take_failures` reports them."""
        logger.error(
            "engine failure on request(s) %s; aborting them",
            ", ".join(p.request_id for p in parents),
            exc_info=exc,
        )
        for parent in parents:
            child_ids = [seq.request.request_id for seq in parent.sequences]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(parent)
            self.failed[parent.request_id] = exc

    def take_failures(self) -> dict[str, Exception]:
        """Requests that failed (and were aborted) since the last call: id -> error."""
        failed, self.failed = self.failed, {}
        return failed

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
