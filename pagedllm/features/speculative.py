"""Speculative decoding in the step (``--speculative-config``): room for draft tokens after
a decoding request's known one, the proposer's drafts, the verified tokens kept, and the
counters behind the metrics."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension, StepOutcome
from pagedllm.core.pooling import POOLING_TASKS
from pagedllm.core.spec_decode import (
    DraftModelProposer,
    SpeculativeConfig,
    can_speculate,
    make_proposer,
    speculation_limit,
    verify_drafts,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from pagedllm.core.request import Request
    from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger("pagedllm.engine")


class SpeculativeExtension(StepExtension):
    """Applies to every request it can verify; no per-request state."""

    name = "spec"

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Any,
        max_model_len: int,
        draft: tuple[Any, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        # With a draft model: (loaded draft model, its KV-cache spec); its proposer is
        # made when the KV cache is (its cache has the target's block layout).
        self.draft = draft
        # Steps that verified drafts, drafts proposed, drafts kept.
        self.stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self._active = False
        # This step's items that got drafts.
        self._drafted: list[ScheduledRequest] = []

    @classmethod
    def from_engine(cls, engine: Any) -> SpeculativeExtension | None:
        """Before the KV cache is sized: a draft model takes its memory first."""
        config = engine.config.speculative_config
        if config is None:
            return None
        if engine.task in POOLING_TASKS:
            raise ConfigError("--speculative-config applies to text generation")
        draft = None
        if config.method == "draft_model":
            if engine.config.model_config.enable_sleep_mode:
                # (the draft model is the extension's, outside the ranks that sleep)
                raise ConfigError(
                    "--enable-sleep-mode with a draft model (--speculative-config "
                    "method draft_model) is not supported yet; leave one of them out"
                )
            draft = load_draft(engine, config)
        draft_len = None if draft is None else draft[0].max_model_len
        # (its limits settled against the models' lengths)
        config = speculation_limit(config, engine.max_model_len, draft_len)
        proposer = None if draft is not None else make_proposer(config)
        return cls(config, proposer, engine.max_model_len, draft)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0 if self.draft is None else self.draft[1].bytes_per_block(block_size)

    def kv_cache_ready(self, engine: Any, num_blocks: int) -> None:
        if self.draft is None:
            return
        config = engine.config
        backend = engine.attention_backend_cls
        self.proposer = DraftModelProposer(
            self.draft[0].model,
            self.draft[1],
            num_blocks,
            config.cache_config.block_size,
            backend(),
            config.device_config.torch_device,
            engine.vocab_size,
        )

    def runner_payload(self) -> Any:
        return True

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> DraftVerifier:
        return DraftVerifier(worker.config.device_config.torch_device)

    def begin_step(self, running: list[Request]) -> list[tuple[Request, BaseException]]:
        limit = self.config.disable_by_batch_size
        self._active = self.proposer is not None and (limit is None or len(running) < limit)
        self._drafted = []
        return []

    def extra_tokens(self, request: Request, budget: int) -> int:
        """As many draft tokens as its budget, its max_tokens and the model length leave
        after the token it samples anyway."""
        if not self._active or not can_speculate(request):
            return 0
        k = self.config.num_speculative_tokens
        limit = self.config.max_model_len
        if limit is not None and request.num_tokens + k >= limit:
            return 0  # (too long for the draft: plain decoding from now on)
        params = request.sampling_params
        room = self.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return max(0, min(k, room, budget - 1))

    def propose(self, items: list[tuple[ScheduledRequest, int]]) -> int:
        """The proposer's drafts (a draft model writes its KV in the items' slots); a
        request given fewer than its room gives the rest of its tokens back."""
        wanted = [(item.request, room, item.block_ids) for item, room in items]
        returned = 0
        for (item, room), drafts in zip(items, self.proposer.propose(wanted), strict=True):
            drafts = list(drafts)[:room]
            item.extra_token_ids = drafts
            item.num_new_tokens -= room - len(drafts)
            returned += room - len(drafts)
            if drafts:
                self._drafted.append(item)
        return returned

    def read_outputs(self, output: SchedulerOutput, result: RunnerOutput) -> dict[str, StepOutcome]:
        outcomes = {}
        stats = self.stats
        for item in self._drafted:
            request = item.request
            tokens = result.spec_token_ids.get(request.request_id)
            if tokens is None or request.is_finished:
                continue
            # The kept drafts' KV is valid; the rejected ones' slots are rewritten later.
            stats["drafts"] += 1
            stats["draft_tokens"] += len(item.extra_token_ids)
            stats["accepted_tokens"] += len(tokens) - 1
            outcomes[request.request_id] = StepOutcome(tokens, computed=len(tokens) - 1)
        return outcomes


class DraftVerifier(RunnerExtension):
    """The runner's side: the target's distributions at a drafted request's last known
    token and at each draft (a row block each), and the tokens the rejection sampler
    keeps."""

    name = "spec"

    def __init__(self, device: Any) -> None:
        self.device = device

    def claim(
        self, item: ScheduledRequest, offset: int, add_rows: Callable[[int, int], int]
    ) -> Any:
        drafts = item.extra_token_ids
        if not drafts:
            return None
        # The last known token's row and each draft's: k + 1 distributions.
        first = offset + item.num_new_tokens - 1 - len(drafts)
        return add_rows(first, len(drafts) + 1)

    def finish(
        self,
        claims: list[tuple[ScheduledRequest, Any]],
        hidden: torch.Tensor,
        logits_of: Callable[[int], torch.Tensor],
        result: RunnerOutput,
    ) -> None:
        for item, block in claims:
            request = item.request
            result.spec_token_ids[request.request_id] = verify_drafts(
                request, logits_of(block), item.extra_token_ids, self.device
            )


def load_draft(engine: Any, spec: SpeculativeConfig) -> tuple[Any, Any]:
    """Load ``spec.model`` as the draft model: ``(loaded model, its KV-cache spec)`` (its
    cache gets the target's block layout). With tensor-parallel ranks or pipeline stages
    it is whole in this process (rank 0, which proposes), as vLLM's
    ``draft_tensor_parallel_size`` 1."""
    import torch

    from pagedllm.core.config import ParallelConfig
    from pagedllm.core.kv_cache.spec import kv_cache_spec, kv_cache_torch_dtype
    from pagedllm.core.model_setup import load_model

    config = engine.config
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
        scheduler_config=dataclasses.replace(config.scheduler_config, enable_chunked_prefill=True),
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
            draft = load_model(draft_config, engine.pm)
        except ConfigError as exc:
            if "states no context length" not in str(exc):
                raise
            # A draft whose config states none runs within the speculative config's
            # max_model_len, else the target's context (as it did before drafts had
            # their own).
            length = spec.max_model_len or engine.max_model_len
            draft_config = dataclasses.replace(
                draft_config,
                model_config=dataclasses.replace(draft_config.model_config, max_model_len=length),
            )
            draft = load_model(draft_config, engine.pm)
    finally:
        torch.set_num_threads(threads)
    ours, theirs = engine.tokenizer, draft.tokenizer
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
