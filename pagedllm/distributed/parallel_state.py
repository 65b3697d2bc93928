"""This process's rank in the tensor-parallel or pipeline-parallel group, and the
collectives and transfers the parallel layers and stages use.

Each process of a tensor-parallel engine is one rank: the engine's own process is rank 0
(it schedules, and samples from the gathered logits), the worker processes ranks 1 to
N - 1. ``torch.distributed`` carries the collectives: gloo between CPU processes, NCCL
between GPUs. With one rank (the default, and every engine without ``-tp``) nothing is
initialised and every collective returns its input.

With pipeline parallelism (``-pp N``) each process is a stage instead: it holds a
contiguous range of the decoder layers (:func:`stage_layers`), stage 0 also the embedding
and the vocabulary head, the last stage the final norm. Hidden states travel stage to
stage by point-to-point sends.

The state is per process (one engine per process is a rank of at most one group):
:func:`set_tensor_parallel` / :func:`set_pipeline_parallel` set it before the model is
built, so that layers shard themselves (or are left to another stage) as they are
constructed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # --enable-expert-parallel: the ranks split the experts of MoE layers (each holds
    # whole experts) instead of each expert's intermediate rows.
    experts: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineParallel:
    rank: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


_state = TensorParallel()
_pipeline = PipelineParallel()
# The collectives' group of this stage's tensor-parallel ranks with pipeline parallelism
# too (None: the whole world, every rank a tensor-parallel rank).
_tp_group: Any = None
# The group of the last pipeline stage's transfers back to stage 0.
_return_group: Any = None


def pipeline_parallel() -> PipelineParallel:
    """This process's pipeline stage and the number of stages."""
    return _pipeline


def set_pipeline_parallel(rank: int, size: int) -> None:
    """Record this process's pipeline stage (models built from now on hold its layers)."""
    global _pipeline
    if not 0 <= rank < size:
        raise ValueError(f"stage {rank} is not in a pipeline of {size}")
    _pipeline = PipelineParallel(rank, size)


# The layers of each stage, as vLLM's variable gives them ("11,19": stage 0 holds 11 of
# 30, stage 1 the other 19); ours first.
PARTITION_VARIABLES = ("PAGEDLLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")


def layer_partition(num_layers: int, size: int, env: Mapping[str, str] = os.environ) -> list[int]:
    """How many of the ``num_layers`` decoder layers each of ``size`` stages holds: the
    counts ``PAGEDLLM_PP_LAYER_PARTITION`` (or vLLM's ``VLLM_PP_LAYER_PARTITION``) lists
    where set; else equal shares, the later stages one more each where the layers do
    not divide evenly (stage 0 also embeds the tokens, computes the logits and samples).
    A list that is not ``size`` counts of at least one layer adding up to ``num_layers``
    is a ``ValueError`` naming the variable."""
    for name in PARTITION_VARIABLES:
        text = env.get(name, "").strip()
        if not text:
            continue
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            counts = []
        if len(counts) != size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{name}={text!r}: give {size} comma-separated layer counts, one per pipeline "
                f"stage, each at least 1, adding up to the model's {num_layers} layers"
            )
        return counts
    share, extra = divmod(num_layers, size)
    return [share + (1 if i >= size - extra else 0) for i in range(size)]


def stage_layers(num_layers: int, rank: int | None = None, size: int | None = None) -> range:
    """The decoder layers pipeline stage ``rank`` of ``size`` holds
    (:func:`layer_partition`)."""
    rank = _pipeline.rank if rank is None else rank
    size = _pipeline.size if size is None else size
    counts = layer_partition(num_layers, size)
    start = sum(counts[:rank])
    return range(start, start + counts[rank])


def tensor_parallel() -> TensorParallel:
    """This process's tensor-parallel rank and group size."""
    return _state


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def set_tensor_parallel(rank: int, size: int, experts: bool = False) -> None:
    """Record this process's rank (layers built from now on shard for it); ``experts``:
    MoE layers split by expert (:func:`expert_parallel`)."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    _state = TensorParallel(rank, size, experts)


def expert_parallel() -> bool:
    """Whether MoE layers built now split their experts over the tensor-parallel ranks
    (each rank whole experts) rather than each expert's rows (``--enable-expert-parallel``
    with several ranks)."""
    return _state.experts and _state.size > 1


@contextlib.contextmanager
def building(size: int, stages: int = 1) -> Iterator[None]:
    """Layers built inside shard for ``size`` ranks and ``stages`` pipeline stages: a
    one-rank model built in a process that is a rank of a tensor-parallel engine (or a
    stage of a pipeline) is built whole (every choice a layer makes between one rank and
    several is made when it is built)."""
    global _state, _pipeline
    previous, previous_stage = _state, _pipeline
    _state = _state_to_build(previous, size, "tensor-parallel ranks")
    _pipeline = _state_to_build(previous_stage, stages, "pipeline stages")
    try:
        yield
    finally:
        _state, _pipeline = previous, previous_stage


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Run this rank's shard without the other ranks: :func:`all_reduce` and
    :func:`all_gather` leave tensors as they are inside. For a forward whose values do not
    matter (a probe of the model's shapes while it is being built), which the other ranks
    do not run in step with this one."""
    global _state
    previous = _state
    _state = TensorParallel(experts=previous.experts)
    try:
        yield
    finally:
        _state = previous


def _state_to_build(state: Any, size: int, what: str) -> Any:
    """The state to build a model of ``size`` (ranks or stages) with in a process whose
    state is ``state``: its own, or the one-rank default."""
    if size == 1 and state.size > 1:
        return type(state)()
    if size != state.size:
        raise RuntimeError(
            f"building a model for {size} {what} in a process of a group of {state.size}"
        )
    return state


def init_distributed(
    rank: int,
    size: int,
    init_method: str,
    backend: str,
    timeout_s: float = 600.0,
    stages: int = 1,
    experts: bool = False,
) -> None:
    """Join the process group of ``size`` tensor-parallel ranks times ``stages`` pipeline
    stages at ``init_method`` (``tcp://host:port``) as ``rank``, with ``backend``
    (``gloo``, ``nccl``), and record this process's place: stage ``rank // size``,
    tensor-parallel rank ``rank % size`` within it (``experts``: its MoE layers split by
    expert). With both, each stage's ranks get a group of their own for their
    collectives."""
    global _tp_group, _return_group
    world = size * stages
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    stage = rank // size
    if size > 1 and stages > 1:
        # (Every rank makes every group, in the same order.)
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first == stage * size:
                _tp_group = group
    if stages > 1:
        # The last stage's sends back to stage 0 in a group of their own: with two
        # stages they join the same two ranks as the forward sends, in the other
        # direction, and NCCL orders all of one group's transfers between two ranks on
        # one stream (a send waiting for its receive would hold up the other direction).
        _return_group = dist.new_group(list(range(world)))
    set_tensor_parallel(rank % size, size, experts)
    set_pipeline_parallel(stage, stages)


def stage_peer(stage: int) -> int:
    """The global rank of this process's tensor-parallel rank in pipeline stage
    ``stage`` (where this rank's hidden states go to or come from)."""
    return stage * _state.size + _state.rank


def return_group() -> Any:
    """The group the last pipeline stage sends the final hidden states to stage 0 in."""
    return _return_group


def destroy_distributed() -> None:
    global _state, _pipeline, _tp_group, _return_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()
    _pipeline = PipelineParallel()
    _tp_group = _return_group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place; ``x`` itself with one rank)."""
    if _state.size > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, rank 0 first (``x`` with one rank)."""
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s equal share of ``total`` items (``total`` must
    divide evenly)."""
    rank = _state.rank if rank is None else rank
    size = _state.size if size is None else size
    if total % size:
        raise ValueError(f"{total} does not divide into {size} equal shares")
    share = total // size
    return rank * share, share
