"""Runs one scheduled step: flattens the batch, runs the model, samples.

All scheduled tokens of all requests form one flat batch (token ids, positions, cache
slots); attention metadata says where each request's context lives in the paged cache.
Logits are computed only for the rows that need them: each request's last token when the
step reaches its end (it samples), and prompt positions of requests asking for prompt
logprobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.kv_cache.spec import KVCacheSpec
from pagedllm.core.sampling import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.core.step_data import RunnerOutput
from pagedllm.core.transfer import host_tensor
from pagedllm.kernels.batch_invariant import batch_invariant_mode

if TYPE_CHECKING:
    from pagedllm.core.step_data import SchedulerOutput


@dataclasses.dataclass(slots=True)
class StepInput:
    """What computing a step takes, without the requests: the flat batch (token ids,
    positions, each request's query and context length and blocks), the rows whose logits
    are computed (sampled rows; each speculative verification's and each prompt-logprobs
    request's ``(first row, count)``, in that order) and the KV blocks to copy first.
    Rank 0 sends it to tensor-parallel workers."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    query_lens: list[int] = dataclasses.field(default_factory=list)
    context_lens: list[int] = dataclasses.field(default_factory=list)
    block_tables: list[list[int]] = dataclasses.field(default_factory=list)
    sample_rows: list[int] = dataclasses.field(default_factory=list)
    spec_rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    prompt_rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # With --enable-lora: the adapter slots rank 0 filled for this step (with the
    # adapters), and each request's slot (empty without adapters in the step; see
    # LoRAManager.follow_step).
    lora_fills: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    lora_slots: list[int] = dataclasses.field(default_factory=list)
    # An encoder's token types (segment ids), one per token (empty: zeros).
    token_type_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class StepPlan:
    """Rank 0's side of a step, beside its :class:`StepInput`: the requests that sample,
    verify drafts, pool or take prompt logprobs, in the order of their row blocks."""

    sampling_requests: list[Any] = dataclasses.field(default_factory=list)
    spec_rows: list[tuple[Any, list[int]]] = dataclasses.field(default_factory=list)
    pooling_rows: list[tuple[Any, int, Any]] = dataclasses.field(default_factory=list)
    prompt_rows: list[tuple[Any, list[int]]] = dataclasses.field(default_factory=list)


class ModelRunner:
    """One rank's model and KV cache. A step is :meth:`build_step` (rank 0: the flat
    batch from the scheduler's output), :meth:`hidden_states`, :meth:`logits` of each of
    :meth:`row_blocks`, then :meth:`finish` (rank 0: sampling and the rest), all within
    :meth:`step_mode`; :meth:`execute` is all of them. The runner knows nothing of other
    ranks: an executor sends them the step input (see :mod:`pagedllm.executors`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        attention_backend: Any,
        reserved_blocks: int = 0,
        batch_invariant: bool = False,
        pooler_configs: dict[str, Any] | None = None,
        lora: Any = None,
        decode_graphs: Callable[[ModelRunner], Any] | None = None,
    ) -> None:
        self.model = model
        # --batch-invariant: each step computed in the kernels' batch-invariant mode.
        self.batch_invariant = batch_invariant
        self.attention_backend = attention_backend
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Blocks past the KV manager's num_blocks, which never hold a request's tokens:
        # the padding rows of a replayed decode graph write and read pad_block.
        self.pad_block = num_blocks
        self.kv_caches = spec.allocate(num_blocks + reserved_blocks, block_size, device)
        self.sampler = Sampler()
        # The pooler of each pooling task the engine serves.
        self.pooler_configs: dict[str, Any] = pooler_configs or {}
        # --enable-lora: the adapters' manager, told each step's requests.
        self.lora = lora
        # The device's replayer of decode steps (Device.decode_graphs), built on this
        # runner's cache.
        self.graphs = None if decode_graphs is None else decode_graphs(self)

    def execute(
        self, output: SchedulerOutput, token_mask: torch.Tensor | None = None
    ) -> RunnerOutput:
        """Compute the scheduled tokens and sample for the requests whose step reaches
        their end. ``token_mask`` (bool ``[sampling rows, vocab]``, True = allowed, rows
        in the order of ``output.sampling_requests``) constrains guided requests. Each
        row block's logits are computed when asked for (one at a time)."""
        with self.step_mode():
            step, plan = self.build_step(output)
            hidden = self.hidden_states(step)
            blocks = self.row_blocks(step)
            return self.finish(plan, hidden, lambda i: self.logits(hidden, blocks[i]), token_mask)

    @contextlib.contextmanager
    def step_mode(self) -> Iterator[None]:
        """Within: a step's computation (inference mode; --batch-invariant's kernels)."""
        with batch_invariant_mode(self.batch_invariant), torch.inference_mode():
            yield

    def build_step(self, output: SchedulerOutput) -> tuple[StepInput, StepPlan]:
        """The step's input (what every rank computes) and rank 0's plan of it. With
        adapters, sets the step's adapter slots (before the input goes to other ranks,
        which fill the same slots)."""
        step = StepInput(blocks_to_copy=list(output.blocks_to_copy))
        plan = StepPlan()
        offset = 0
        for item in output.scheduled:
            request = item.request
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            drafts = item.draft_token_ids
            step.token_ids.extend(request.all_token_ids[start : end - len(drafts)])
            step.token_ids.extend(drafts)
            step.positions.extend(range(start, end))
            step.query_lens.append(item.num_new_tokens)
            step.context_lens.append(end)
            step.block_tables.append(item.block_ids)
            if request.pooling_params is not None:
                if item.reaches_end:
                    plan.pooling_rows.append((request, offset, item))
            elif drafts:
                # The last known token's row and each draft's: k + 1 distributions.
                first = offset + item.num_new_tokens - 1 - len(drafts)
                step.spec_rows.append((first, len(drafts) + 1))
                plan.spec_rows.append((request, drafts))
            elif item.reaches_end:
                step.sample_rows.append(offset + item.num_new_tokens - 1)
                plan.sampling_requests.append(request)
            if request.sampling_params.prompt_logprobs is not None:
                # Positions predicting the next prompt token: p in [start, num_prompt - 1).
                last = min(end, request.num_prompt_tokens - 1)
                if last > start:
                    step.prompt_rows.append((offset, last - start))
                    targets = request.prompt_token_ids[start + 1 : last + 1]
                    plan.prompt_rows.append((request, targets))
            offset += item.num_new_tokens
        if getattr(self.model, "is_encoder", False):
            step.token_type_ids = self._token_type_ids(output)
        if self.lora is not None:
            self.lora.set_step([(item.request, item.num_new_tokens) for item in output.scheduled])
            step.lora_fills, step.lora_slots = self.lora.step_fills, self.lora.step_slots
        return step, plan

    def finish(
        self,
        plan: StepPlan,
        hidden: torch.Tensor,
        logits_of: Callable[[int], torch.Tensor],
        token_mask: torch.Tensor | None = None,
    ) -> RunnerOutput:
        """Rank 0's results of a step from its hidden states and ``logits_of(i)``, the
        logits of row block ``i`` (:meth:`row_blocks`): sampled tokens, verified drafts,
        pooled results, prompt logprobs."""
        result = RunnerOutput()
        sampling_requests = plan.sampling_requests
        if sampling_requests:
            logits = logits_of(0)
            sampling = SamplingMetadata.from_requests(
                sampling_requests, logits.shape[-1], self.device
            )
            sampling.token_mask = token_mask
            sampled = self.sampler(logits, sampling)
            for i, request in enumerate(sampling_requests):
                result.sampled_token_ids[request.request_id] = sampled.sampled_token_ids[i]
                if sampled.logprobs is not None and request.sampling_params.logprobs is not None:
                    result.logprobs[request.request_id] = sampled.logprobs.row(i)
        blocks = iter(range(1, 1 + len(plan.spec_rows) + len(plan.prompt_rows)))
        for request, drafts in plan.spec_rows:
            result.spec_token_ids[request.request_id] = self._verify(
                request, logits_of(next(blocks)), drafts
            )
        for request, start, item in plan.pooling_rows:
            result.pooled[request.request_id] = self._pool(
                request, hidden[start : start + item.num_new_tokens], item
            )
        for request, targets in plan.prompt_rows:
            logits = logits_of(next(blocks))
            result.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits,
                torch.tensor(targets, dtype=torch.long, device=self.device),
                request.sampling_params.prompt_logprobs,
            )
        return result

    def row_blocks(self, step: StepInput) -> list[torch.Tensor | None]:
        """The rows whose logits a step computes, block by block, in the order every
        rank computes them: the sampled rows (None when none), each verification's, each
        prompt-logprobs request's."""
        blocks: list[torch.Tensor | None] = [
            host_tensor(step.sample_rows, torch.long, self.device) if step.sample_rows else None
        ]
        for first, count in (*step.spec_rows, *step.prompt_rows):
            blocks.append(torch.arange(first, first + count, device=self.device))
        return blocks

    def follow(self, step: StepInput) -> None:
        """A tensor-parallel rank's part of a step rank 0 built: the forward pass and the
        logits of the row blocks rank 0 computes them for, in its order (each takes part
        in collectives); rank 0 samples."""
        with self.step_mode():
            hidden = self.hidden_states(step, follow_adapters=step.lora_fills)
            for rows in self.row_blocks(step):
                if rows is not None:
                    self.logits(hidden, rows)

    def whole_step_adapters(self, step: StepInput) -> None:
        """After a pipeline's micro-batches: the step's adapters by row again (the
        vocabulary head's adapter applies to rows of every micro-batch)."""
        if self.lora is not None:
            self.lora.follow_step([], step.lora_slots, step.query_lens)

    def hidden_states(
        self,
        step: StepInput,
        intermediate: torch.Tensor | None = None,
        *,
        follow_adapters: list[tuple[int, Any]] | None = None,
    ) -> torch.Tensor:
        """The step's hidden states: replayed from a graph where one covers the step,
        else computed eagerly (``intermediate``: a pipeline stage's input, the previous
        stage's hidden states). ``follow_adapters``: for a step rank 0 did not build
        here (another rank's, a pipeline's micro-batch), the adapter slots to fill
        before the step's adapters are set by row (None: :meth:`build_step` set them)."""
        if step.blocks_to_copy:
            self._copy_blocks(step.blocks_to_copy)
        graphs = self.graphs
        if (
            graphs is not None
            and len(step.token_ids) == len(step.query_lens)  # one token each: decodes only
            and graphs.covers(len(step.token_ids), max(step.context_lens))
        ):
            return graphs.run(step.token_ids, step.positions, step.context_lens, step.block_tables)
        return self._forward(step, intermediate, follow_adapters)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer's cache."""
        sources = torch.tensor([c[0] for c in copies], device=self.device)
        destinations = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:
            if cache.dim() > 1:  # (a layer of this pipeline stage)
                cache[:, destinations] = cache[:, sources]

    def _forward(
        self,
        step: StepInput,
        intermediate: torch.Tensor | None,
        follow_adapters: list[tuple[int, Any]] | None,
    ) -> torch.Tensor:
        """The step's hidden states, computed eagerly."""
        metadata = self.attention_backend.build_metadata(
            step.query_lens,
            step.context_lens,
            step.block_tables,
            self.block_size,
            self.kv_caches,
            self.device,
        )
        input_ids = host_tensor(step.token_ids, torch.long, self.device)
        input_positions = host_tensor(step.positions, torch.long, self.device)
        if self.lora is not None and follow_adapters is not None:
            self.lora.follow_step(follow_adapters, step.lora_slots, step.query_lens)
        if getattr(self.model, "is_encoder", False):
            # An encoder attends within each prompt, both ways, and reads token types.
            types = step.token_type_ids or [0] * len(step.token_ids)
            self.model.token_type_ids = host_tensor(types, torch.long, self.device)
            self.model.step_ranges = list(
                itertools.pairwise(itertools.accumulate(step.query_lens, initial=0))
            )
        if intermediate is not None:
            return self.model(input_ids, input_positions, metadata, intermediate)
        return self.model(input_ids, input_positions, metadata)

    def _pool(self, request: Any, hidden: torch.Tensor, item: Any) -> torch.Tensor:
        """A pooling request's result from the hidden states of its whole prompt (the
        engine schedules pooling prompts whole: no chunks, no cached prefix)."""
        from pagedllm.core.pooling import activate, select_rows

        if item.num_computed_tokens != 0:
            raise RuntimeError("a pooling prompt must be computed in one step")
        params = request.pooling_params
        config = self.pooler_configs[params.task]
        rows = select_rows(hidden, request.prompt_token_ids, config)
        scores = self.model.pooling_head(rows, params.task)
        return activate(scores, params.task, config, params).cpu()

    def _token_type_ids(self, output: SchedulerOutput) -> list[int]:
        """The step's token types (segment ids), in the order of its tokens: each
        pooling request's own where it has them, else zeros."""
        types: list[int] = []
        for item in output.scheduled:
            params = item.request.pooling_params
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            given = params.token_type_ids if params is not None else None
            types.extend(given[start:end] if given else [0] * (end - start))
        return types

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits of ``rows`` of the step's hidden states (an adapter on
        the head applies to the rows of its requests)."""
        if self.lora is None:
            return self.model.compute_logits(hidden[rows])
        with self.lora.rows(rows):
            return self.model.compute_logits(hidden[rows])

    def _verify(self, request: Any, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """Speculative decoding: the target's distributions at the last known token and
        each draft (processed as the sampler processes them), and the tokens the
        rejection sampler keeps (see :mod:`pagedllm.core.spec_decode`)."""
        from pagedllm.core.sampling.sampler import apply_logits_processing, warp
        from pagedllm.core.spec_decode import accept_drafts

        logits = logits.float().contiguous()
        md = SamplingMetadata.from_requests([request] * len(logits), logits.shape[-1], self.device)
        apply_logits_processing(logits, md)
        if md.all_greedy:
            return accept_drafts(None, logits.argmax(dim=-1), drafts, None)
        warp(logits, md)
        return accept_drafts(logits.softmax(dim=-1), None, drafts, md.generators.get(0))


@torch.inference_mode()
def profile_step(
    model: torch.nn.Module,
    backend: Any,
    spec: KVCacheSpec,
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    device: torch.device,
    max_model_len: int | None = None,
) -> int:
    """Compute a step of ``num_tokens`` prompt tokens split over ``num_seqs`` requests of
    at most ``max_model_len`` tokens (the largest step the scheduler makes) and their
    sampling rows' logits, on a throwaway KV cache, so that a device can measure its
    memory peak (``Device.measure_peak_memory``). Returns the throwaway cache's bytes,
    which the peak leaves out."""
    if max_model_len is not None:
        num_tokens = min(num_tokens, num_seqs * max_model_len)
    seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // seqs + (1 if i < num_tokens % seqs else 0) for i in range(seqs)]
    tables: list[list[int]] = []
    blocks = 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(blocks, blocks + count)))
        blocks += count
    caches = spec.allocate(blocks, block_size, device)
    metadata = backend.build_metadata(lens, lens, tables, block_size, caches, device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    if getattr(model, "is_encoder", False):
        model.token_type_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        model.step_ranges = list(itertools.pairwise(itertools.accumulate(lens, initial=0)))
        model(input_ids, positions, metadata)
    else:
        hidden = model(input_ids, positions, metadata)
        rows = torch.tensor(list(itertools.accumulate(lens)), device=device) - 1
        # The sampler's float32 logits and their softmax.
        model.compute_logits(hidden[rows]).float().softmax(dim=-1)
    return sum(cache.numel() * cache.element_size() for cache in caches)
