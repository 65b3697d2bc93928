"""Runs one scheduled step: flattens the batch, runs the model, samples.

All scheduled tokens of all requests form one flat batch (token ids, positions, cache
slots); attention metadata says where each request's context lives in the paged cache.
Logits are computed only for the rows that need them: each request's last token when the
step reaches its end (it samples), and prompt positions of requests asking for prompt
logprobs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.errors import EngineDeadError
from pagedllm.core.sampling import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.core.step_data import RunnerOutput
from pagedllm.core.transfer import host_tensor
from pagedllm.distributed.parallel_state import pipeline_parallel
from pagedllm.kernels.batch_invariant import batch_invariant_mode

if TYPE_CHECKING:
    from pagedllm.core.step_data import SchedulerOutput


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # The layers whose caches this rank holds (a pipeline stage's); None: every layer.
    layers: range | None = None

    @property
    def num_held_layers(self) -> int:
        return self.num_layers if self.layers is None else len(self.layers)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_held_layers * block_size * self.num_kv_heads * self.head_dim * element

    def allocate(
        self, num_blocks: int, block_size: int, device: torch.device
    ) -> list[torch.Tensor]:
        """One cache per layer, ``[2, num_blocks, block_size, kv heads, head dim]``; an
        empty tensor for a layer another pipeline stage holds. Not zero-filled: memory is
        committed only as blocks are written, and attention never reads a slot before it
        is written (padding repeats a written slot)."""
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        held = range(self.num_layers) if self.layers is None else self.layers
        return [
            torch.empty(shape if i in held else (0,), dtype=self.dtype, device=device)
            for i in range(self.num_layers)
        ]


_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(cache_config: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype`` (``auto``: the model's)."""
    return _KV_CACHE_DTYPES.get(cache_config.kv_cache_dtype, model_dtype)


def set_kv_scales(model: torch.nn.Module, cache_config: Any, kv_dtype: torch.dtype) -> None:
    """The scales an fp8 KV cache stores keys and values with, on every attention layer
    of ``model`` (each tensor-parallel rank's): computed from the first batch with
    ``--calculate-kv-scales``, else the checkpoint's own where it was quantized for an
    fp8 cache (1.0 otherwise)."""
    from pagedllm.core.attention.layer import Attention

    for module in model.modules():
        if not isinstance(module, Attention):
            continue
        if cache_config.calculate_kv_scales:
            module.calculate_kv_scales = True
        elif kv_dtype == torch.float8_e4m3fn:
            module.k_scale = getattr(module, "checkpoint_k_scale", 1.0)
            module.v_scale = getattr(module, "checkpoint_v_scale", 1.0)


def kv_cache_spec(
    hf_config: Any,
    dtype: torch.dtype,
    tp: int = 1,
    layers: range | None = None,
    model: Any = None,
) -> KVCacheSpec:
    """The KV cache of one rank of ``tp`` tensor-parallel ranks: its share of the KV
    heads, or one head where there are fewer KV heads than ranks (each replicated);
    ``layers``: a pipeline stage's (None: all). The model's own shape where it gives one
    (``ModelArchitecture.kv_cache_shape``)."""
    shape = getattr(model, "kv_cache_shape", lambda: None)()
    if shape is not None:
        return KVCacheSpec(*shape, dtype, layers)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    kv_heads = max(1, kv_heads // tp)
    return KVCacheSpec(hf_config.num_hidden_layers, kv_heads, head_dim, dtype, layers)


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


class ModelRunner:
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
        # The pooler of each pooling task the engine serves (set by the engine).
        self.pooler_configs: dict[str, Any] = {}
        # --enable-lora: the adapters' manager, told each step's requests (set by the engine).
        self.lora: Any = None
        # The device's replayer of decode steps (Device.decode_graphs), set by the engine.
        self.graphs: Any = None
        # Tensor parallelism, on rank 0: the other ranks' worker group (its step() sends
        # them each step's StepInput), set by the engine.
        self.workers: Any = None
        # Pipeline parallelism: on rank 0, the stages' driver (PipelineStages); on every
        # rank, the size and type of the hidden states between stages and of the final
        # ones (set by the engine and the workers).
        self.pipeline: Any = None
        self.hidden_size = self.output_size = 0
        self.hidden_dtype = torch.float32

    def execute(
        self, output: SchedulerOutput, token_mask: torch.Tensor | None = None
    ) -> RunnerOutput:
        """Compute the scheduled tokens and sample for the requests whose step reaches
        their end. ``token_mask`` (bool ``[sampling rows, vocab]``, True = allowed, rows
        in the order of ``output.sampling_requests``) constrains guided requests.

        With tensor-parallel workers (``self.workers``), the step's :class:`StepInput` goes
        to them first; they compute the same forward pass and logits (:meth:`follow`),
        joining this process's collectives."""
        with batch_invariant_mode(self.batch_invariant):
            return self._execute(output, token_mask)

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput, token_mask: torch.Tensor | None) -> RunnerOutput:
        step = StepInput(blocks_to_copy=list(output.blocks_to_copy))
        sampling_requests = []
        prompt_rows: list[tuple[Any, list[int]]] = []
        pooling_rows: list[tuple[Any, int, Any]] = []
        spec_rows: list[tuple[Any, list[int]]] = []
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
                    pooling_rows.append((request, offset, item))
            elif drafts:
                # The last known token's row and each draft's: k + 1 distributions.
                first = offset + item.num_new_tokens - 1 - len(drafts)
                step.spec_rows.append((first, len(drafts) + 1))
                spec_rows.append((request, drafts))
            elif item.reaches_end:
                step.sample_rows.append(offset + item.num_new_tokens - 1)
                sampling_requests.append(request)
            if request.sampling_params.prompt_logprobs is not None:
                # Positions predicting the next prompt token: p in [start, num_prompt - 1).
                last = min(end, request.num_prompt_tokens - 1)
                if last > start:
                    step.prompt_rows.append((offset, last - start))
                    prompt_rows.append((request, request.prompt_token_ids[start + 1 : last + 1]))
            offset += item.num_new_tokens
        if getattr(self.model, "is_encoder", False):
            step.token_type_ids = self._token_type_ids(output)
        if self.lora is not None:
            # (before the step goes to the other ranks, which fill the same slots)
            self.lora.set_step([(item.request, item.num_new_tokens) for item in output.scheduled])
            step.lora_fills, step.lora_slots = self.lora.step_fills, self.lora.step_slots
        hidden, logits_of = self._compute(step, output)

        result = RunnerOutput()
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
        blocks = iter(range(1, 1 + len(step.spec_rows) + len(step.prompt_rows)))
        for request, drafts in spec_rows:
            result.spec_token_ids[request.request_id] = self._verify(
                request, logits_of(next(blocks)), drafts
            )
        for request, start, item in pooling_rows:
            result.pooled[request.request_id] = self._pool(
                request, hidden[start : start + item.num_new_tokens], item
            )
        for request, targets in prompt_rows:
            logits = logits_of(next(blocks))
            result.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits,
                torch.tensor(targets, dtype=torch.long, device=self.device),
                request.sampling_params.prompt_logprobs,
            )
        return result

    def set_stage_io(self, loaded: Any) -> None:
        """A pipeline rank's hidden states between stages: the model's hidden size and
        type, and the width of the final ones (the head's input)."""
        self.hidden_size = loaded.hf_config.hidden_size
        self.output_size = loaded.model.head_input_size
        self.hidden_dtype = loaded.dtype

    def _row_blocks(self, step: StepInput) -> list[torch.Tensor | None]:
        """The rows whose logits a step computes, block by block, in the order every
        rank computes them: the sampled rows (None when none), each verification's, each
        prompt-logprobs request's."""
        blocks: list[torch.Tensor | None] = [
            host_tensor(step.sample_rows, torch.long, self.device) if step.sample_rows else None
        ]
        for first, count in (*step.spec_rows, *step.prompt_rows):
            blocks.append(torch.arange(first, first + count, device=self.device))
        return blocks

    def _compute(self, step: StepInput, output: SchedulerOutput) -> tuple[torch.Tensor, Any]:
        """The step's hidden states and ``logits_of(i)``, the logits of row block ``i``
        (:meth:`_row_blocks`). With workers (tensor-parallel ranks, pipeline stages) every
        block is computed here, before any work of rank 0 alone, so the ranks' collectives
        and transfers stay in step; a failure among them stops the engine (the ranks could
        not agree on the next step's collectives any more). Without workers each block is
        computed when asked for (one at a time)."""
        if self.workers is None:
            hidden = self._hidden(step, output)
            blocks = self._row_blocks(step)
            return hidden, lambda i: self._logits(hidden, blocks[i])
        message = step if self.pipeline is None else self.pipeline.split(step)
        self.workers.step(message)
        try:
            if self.pipeline is None:
                hidden = self._hidden(step, output)
            else:
                hidden = self.pipeline.hidden(self, message)
                self._whole_step_adapters(step)
            computed = [
                None if rows is None else self._logits(hidden, rows)
                for rows in self._row_blocks(step)
            ]
        except Exception as exc:
            raise self._stopped(exc) from exc
        return hidden, computed.__getitem__

    def _stopped(self, exc: Exception) -> EngineDeadError:
        """The error that stops the engine after ``exc`` within a step shared with the
        other ranks: a worker that died names itself; else rank 0 is out of step with
        them (they could not agree on the next step's collectives or transfers)."""
        dead = self.workers.check(exc)
        if isinstance(dead, EngineDeadError):
            return dead
        return EngineDeadError(
            f"rank 0 failed within a step, out of step with the other ranks: {exc!r}"
        )

    def follow(self, step: Any) -> None:
        """A worker's part of a step. A tensor-parallel rank computes the forward pass and
        the logits of the row blocks rank 0 computes them for, in its order (each takes
        part in collectives); rank 0 samples. With pipeline stages (``step`` a
        ``PipelineStep``), a rank of a later stage runs its layers on each micro-batch;
        a tensor-parallel rank of stage 0 runs the first stage as rank 0 does, then
        computes the logits with it."""
        with batch_invariant_mode(self.batch_invariant):
            self._follow(step)

    @torch.inference_mode()
    def _follow(self, step: Any) -> None:
        from pagedllm.distributed.pipeline import PipelineStep, first_stage, follow_stage

        if isinstance(step, PipelineStep):
            if pipeline_parallel().rank > 0:
                follow_stage(self, step)
                return
            hidden = first_stage(self, step)
            step = step.step
            self._whole_step_adapters(step)
        else:
            hidden = self._hidden(step, None)
        for rows in self._row_blocks(step):
            if rows is not None:
                self._logits(hidden, rows)

    def _whole_step_adapters(self, step: StepInput) -> None:
        """After a pipeline's micro-batches: the step's adapters by row again (the
        vocabulary head's adapter applies to rows of every micro-batch)."""
        if self.lora is not None:
            self.lora.follow_step([], step.lora_slots, step.query_lens)

    def _hidden(
        self,
        step: StepInput,
        output: SchedulerOutput | None,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's hidden states: replayed from a graph where one covers the step,
        else computed eagerly (``intermediate``: a pipeline stage's input, the previous
        stage's hidden states)."""
        if step.blocks_to_copy:
            self._copy_blocks(step.blocks_to_copy)
        graphs = self.graphs
        if (
            graphs is not None
            and len(step.token_ids) == len(step.query_lens)  # one token each: decodes only
            and graphs.covers(len(step.token_ids), max(step.context_lens))
        ):
            return graphs.run(step.token_ids, step.positions, step.context_lens, step.block_tables)
        return self._forward(output, step, intermediate)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer's cache."""
        sources = torch.tensor([c[0] for c in copies], device=self.device)
        destinations = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:
            if cache.dim() > 1:  # (a layer of this pipeline stage)
                cache[:, destinations] = cache[:, sources]

    def _forward(
        self,
        output: SchedulerOutput | None,
        step: StepInput,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's hidden states, computed eagerly (``output``: the scheduler's, on
        rank 0; None on a worker, which follows the adapters rank 0 chose, and for a
        pipeline's micro-batch)."""
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
        if self.lora is not None and output is None:
            # A rank above 0, or a pipeline's micro-batch (rank 0 set the step's adapters
            # and filled their slots in execute).
            fills = step.lora_fills if self.workers is None else []
            self.lora.follow_step(fills, step.lora_slots, step.query_lens)
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

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
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
