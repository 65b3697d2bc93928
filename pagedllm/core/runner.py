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
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.interfaces.extension import RunnerExtension, overriding
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
    are computed (the sampled rows, then each further row block's ``(first row, count)``:
    a step extension's and each prompt-logprobs request's) and the KV blocks to copy
    first. ``extras``: each step extension's input, by name. Rank 0 sends it to the other
    ranks."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    query_lens: list[int] = dataclasses.field(default_factory=list)
    context_lens: list[int] = dataclasses.field(default_factory=list)
    block_tables: list[list[int]] = dataclasses.field(default_factory=list)
    sample_rows: list[int] = dataclasses.field(default_factory=list)
    logit_rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class StepPlan:
    """Rank 0's side of a step, beside its :class:`StepInput`: the requests that sample
    (the rows of block 0), each step extension's claims (by name) and the
    prompt-logprobs requests with their targets and block."""

    sampling_requests: list[Any] = dataclasses.field(default_factory=list)
    claims: dict[str, list[tuple[Any, Any]]] = dataclasses.field(default_factory=dict)
    prompt_rows: list[tuple[Any, list[int], int]] = dataclasses.field(default_factory=list)


class ModelRunner:
    """One rank's model and KV cache. A step is :meth:`build_step` (rank 0: the flat
    batch from the scheduler's output), :meth:`hidden_states`, :meth:`logits` of each of
    :meth:`row_blocks`, then :meth:`finish` (rank 0: sampling and the rest), all within
    :meth:`step_mode`; :meth:`execute` is all of them. The runner knows nothing of other
    ranks (an executor sends them the step input, see :mod:`pagedllm.executors`) nor of
    features: the step extensions' runner sides (``extensions``) add their inputs and
    read the rows of the requests that do not sample."""

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
        extensions: list[RunnerExtension] | None = None,
        decode_graphs: Callable[[ModelRunner], Any] | None = None,
        time_steps: bool = False,
    ) -> None:
        self.model = model
        # --collect-detailed-traces: each step's RunnerOutput carries its forward and
        # whole-step times (a device synchronization per step; off by default).
        self.time_steps = time_steps
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
        # The step extensions' runner sides, and for each hook those that override it.
        self.extensions = list(extensions or ())
        self._inputs = overriding(self.extensions, RunnerExtension, "step_input")
        self._claimers = overriding(self.extensions, RunnerExtension, "claim")
        self._before = overriding(self.extensions, RunnerExtension, "before_forward")
        self._after = overriding(self.extensions, RunnerExtension, "after_forward")
        self._splitters = overriding(self.extensions, RunnerExtension, "split")
        self._after_micro_batches = overriding(
            self.extensions, RunnerExtension, "after_micro_batches"
        )
        self._row_contexts = overriding(self.extensions, RunnerExtension, "logits_rows")
        self._finishers = overriding(self.extensions, RunnerExtension, "finish")
        # The device's replayer of decode steps (Device.decode_graphs), built on this
        # runner's cache.
        self.graphs = None if decode_graphs is None else decode_graphs(self)

    def execute(
        self, output: SchedulerOutput, token_mask: torch.Tensor | None = None
    ) -> RunnerOutput:
        """Compute the scheduled tokens and sample for the requests whose step reaches
        their end. ``token_mask`` (bool ``[sampling rows, vocab]``, True = allowed, rows
        in the order of ``output.sampling_requests``) constrains their sampling. Each
        row block's logits are computed when asked for (one at a time)."""
        started = time.perf_counter() if self.time_steps else 0.0
        with self.step_mode():
            step, plan = self.build_step(output)
            forward_started = self.synced_clock() if self.time_steps else 0.0
            hidden = self.hidden_states(step)
            forwarded = self.synced_clock() if self.time_steps else 0.0
            blocks = self.row_blocks(step)
            result = self.finish(plan, hidden, lambda i: self.logits(hidden, blocks[i]), token_mask)
        if self.time_steps:
            self.record_times(result, started, forwarded - forward_started)
        return result

    def synced_clock(self) -> float:
        """``time.perf_counter()`` once the device has done the work queued so far."""
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == self.device.type:
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def record_times(self, result: RunnerOutput, started: float, forward_time: float) -> None:
        """Set a timed step's times on its result (``started``: the step's start)."""
        result.model_forward_time = forward_time
        result.model_execute_time = self.synced_clock() - started

    @contextlib.contextmanager
    def step_mode(self) -> Iterator[None]:
        """Within: a step's computation (inference mode; --batch-invariant's kernels)."""
        with batch_invariant_mode(self.batch_invariant), torch.inference_mode():
            yield

    def build_step(self, output: SchedulerOutput) -> tuple[StepInput, StepPlan]:
        """The step's input (what every rank computes) and rank 0's plan of it. The step
        extensions' inputs are made here (before the input goes to other ranks)."""
        step = StepInput(blocks_to_copy=list(output.blocks_to_copy))
        plan = StepPlan()
        claimers = self._claimers
        logit_rows = step.logit_rows

        def add_rows(first: int, count: int) -> int:
            logit_rows.append((first, count))
            return len(logit_rows)  # (block 0 is the sampled rows)

        offset = 0
        for item in output.scheduled:
            request = item.request
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            extra = item.extra_token_ids
            if extra:
                step.token_ids.extend(request.all_token_ids[start : end - len(extra)])
                step.token_ids.extend(extra)
            else:
                step.token_ids.extend(request.all_token_ids[start:end])
            step.positions.extend(range(start, end))
            step.query_lens.append(item.num_new_tokens)
            step.context_lens.append(end)
            step.block_tables.append(item.block_ids)
            if item.samples:
                step.sample_rows.append(offset + item.num_new_tokens - 1)
                plan.sampling_requests.append(request)
            else:
                for extension in claimers:
                    claim = extension.claim(item, offset, add_rows)
                    if claim is not None:
                        plan.claims.setdefault(extension.name, []).append((item, claim))
                        break
            if request.sampling_params.prompt_logprobs is not None:
                # Positions predicting the next prompt token: p in [start, num_prompt - 1).
                last = min(end, request.num_prompt_tokens - 1)
                if last > start:
                    targets = request.prompt_token_ids[start + 1 : last + 1]
                    plan.prompt_rows.append((request, targets, add_rows(offset, last - start)))
            offset += item.num_new_tokens
        for extension in self._inputs:
            data = extension.step_input(output)
            if data is not None:
                step.extras[extension.name] = data
        return step, plan

    def finish(
        self,
        plan: StepPlan,
        hidden: torch.Tensor,
        logits_of: Callable[[int], torch.Tensor],
        token_mask: torch.Tensor | None = None,
    ) -> RunnerOutput:
        """Rank 0's results of a step from its hidden states and ``logits_of(i)``, the
        logits of row block ``i`` (:meth:`row_blocks`): sampled tokens, the step
        extensions' results, prompt logprobs."""
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
        for extension in self._finishers:
            extension.finish(plan.claims.get(extension.name, []), hidden, logits_of, result)
        for request, targets, block in plan.prompt_rows:
            logits = logits_of(block)
            result.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits,
                torch.tensor(targets, dtype=torch.long, device=self.device),
                request.sampling_params.prompt_logprobs,
            )
        return result

    def row_blocks(self, step: StepInput) -> list[torch.Tensor | None]:
        """The rows whose logits a step computes, block by block, in the order every
        rank computes them: the sampled rows (None when none), then each further block."""
        blocks: list[torch.Tensor | None] = [
            host_tensor(step.sample_rows, torch.long, self.device) if step.sample_rows else None
        ]
        for first, count in step.logit_rows:
            blocks.append(torch.arange(first, first + count, device=self.device))
        return blocks

    def follow(self, step: StepInput) -> None:
        """A tensor-parallel rank's part of a step rank 0 built: the forward pass and the
        logits of the row blocks rank 0 computes them for, in its order (each takes part
        in collectives); rank 0 samples."""
        with self.step_mode():
            hidden = self.hidden_states(step, built_here=False)
            for rows in self.row_blocks(step):
                if rows is not None:
                    self.logits(hidden, rows)

    def split_step(self, step: StepInput, requests: slice, tokens: slice, first: bool) -> StepInput:
        """A micro-batch of ``step`` (:func:`split_step`, with this runner's step
        extensions' shares of their inputs)."""
        return split_step(step, requests, tokens, first, self._splitters)

    def after_micro_batches(self, step: StepInput) -> None:
        """After the micro-batches of ``step`` (:meth:`split_step`), before the logits of
        the whole step."""
        for extension in self._after_micro_batches:
            extension.after_micro_batches(step, step.extras.get(extension.name))

    def hidden_states(
        self,
        step: StepInput,
        intermediate: torch.Tensor | None = None,
        *,
        built_here: bool = True,
    ) -> torch.Tensor:
        """The step's hidden states: replayed from a graph where one covers the step,
        else computed eagerly (``intermediate``: the hidden states the model's earlier
        layers computed on another rank). ``built_here``: this runner's :meth:`build_step` made
        ``step`` (False: it came from rank 0, or it is a micro-batch)."""
        if step.blocks_to_copy:
            self._copy_blocks(step.blocks_to_copy)
        for extension in self._before:
            extension.before_forward(step, step.extras.get(extension.name), built_here)
        graphs = self.graphs
        if (
            graphs is not None
            and len(step.token_ids) == len(step.query_lens)  # one token each: decodes only
            and graphs.covers(len(step.token_ids), max(step.context_lens))
        ):
            hidden = graphs.run(
                step.token_ids, step.positions, step.context_lens, step.block_tables
            )
        else:
            hidden = self._forward(step, intermediate)
        for extension in self._after:
            extension.after_forward(step, step.extras.get(extension.name))
        return hidden

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer's cache."""
        sources = torch.tensor([c[0] for c in copies], device=self.device)
        destinations = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:
            if cache.dim() > 1:  # (a layer this rank holds)
                cache[:, destinations] = cache[:, sources]

    def _forward(self, step: StepInput, intermediate: torch.Tensor | None) -> torch.Tensor:
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
        if getattr(self.model, "is_encoder", False):
            # An encoder attends within each prompt, both ways (its token types, when
            # given, come from a step extension's before_forward).
            self.model.step_ranges = list(
                itertools.pairwise(itertools.accumulate(step.query_lens, initial=0))
            )
        if intermediate is not None:
            return self.model(input_ids, input_positions, metadata, intermediate)
        return self.model(input_ids, input_positions, metadata)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits of ``rows`` of the step's hidden states (within the step
        extensions' ``logits_rows``: e.g. an adapter on the head applies to its rows)."""
        if not self._row_contexts:
            return self.model.compute_logits(hidden[rows])
        with contextlib.ExitStack() as stack:
            for extension in self._row_contexts:
                stack.enter_context(extension.logits_rows(rows))
            return self.model.compute_logits(hidden[rows])


def split_step(
    step: StepInput,
    requests: slice,
    tokens: slice,
    first: bool,
    splitters: list[RunnerExtension] | tuple[()] = (),
) -> StepInput:
    """A micro-batch of ``step``: its ``requests`` and ``tokens`` (no logits rows: those
    are computed on the gathered hidden states of the whole step); the KV blocks to copy
    go with the ``first``; each of ``splitters`` takes its share of its input."""
    extras = step.extras
    if splitters and extras:
        extras = dict(extras)
        for extension in splitters:
            if extension.name in extras:
                extras[extension.name] = extension.split(
                    extras[extension.name], requests, tokens, first
                )
    return StepInput(
        token_ids=step.token_ids[tokens],
        positions=step.positions[tokens],
        query_lens=step.query_lens[requests],
        context_lens=step.context_lens[requests],
        block_tables=step.block_tables[requests],
        blocks_to_copy=step.blocks_to_copy if first else [],
        extras=extras,
    )


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
