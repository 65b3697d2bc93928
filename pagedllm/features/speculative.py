"""Speculative decoding in the step (``--speculative-config``): room for draft tokens after
a decoding request's known one, the proposer's drafts, the verified tokens kept, and the
counters behind the metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import StepExtension, StepOutcome
from pagedllm.core.spec_decode import SpeculativeConfig, can_speculate, make_proposer

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput


class SpeculativeExtension(StepExtension):
    """Applies to every request it can verify; no per-request state."""

    name = "spec"

    def __init__(self, config: SpeculativeConfig, proposer: Any, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        # Steps that verified drafts, drafts proposed, drafts kept.
        self.stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self._active = False
        # This step's items that got drafts.
        self._drafted: list[ScheduledRequest] = []

    @classmethod
    def from_engine(cls, engine: Any) -> SpeculativeExtension | None:
        if engine.config.speculative_config is None:
            return None
        if engine.is_pooling:
            raise ConfigError("--speculative-config applies to text generation")
        config = engine.speculative  # (its limits settled against the models' lengths)
        proposer = engine.draft_proposer or make_proposer(config)
        return cls(config, proposer, engine.max_model_len)

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
            item.draft_token_ids = drafts
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
            stats["draft_tokens"] += len(item.draft_token_ids)
            stats["accepted_tokens"] += len(tokens) - 1
            outcomes[request.request_id] = StepOutcome(tokens, computed=len(tokens) - 1)
        return outcomes
