"""This process's rank in the tensor-parallel group and the collectives the parallel
layers use.

Each process of a tensor-parallel engine is one rank: the engine's own process is rank 0
(it schedules, and samples from the gathered logits), the worker processes ranks 1 to
N - 1. ``torch.distributed`` carries the collectives: gloo between CPU processes, NCCL
between GPUs. With one rank (the default, and every engine without ``-tp``) nothing is
initialised and every collective returns its input.

The state is per process (one engine per process is a rank of at most one group):
:func:`set_tensor_parallel` sets it before the model is built, so that layers shard
themselves as they are constructed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1


_state = TensorParallel()


def tensor_parallel() -> TensorParallel:
    """This process's tensor-parallel rank and group size."""
    return _state


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def set_tensor_parallel(rank: int, size: int) -> None:
    """Record this process's rank (layers built from now on shard for it)."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    _state = TensorParallel(rank, size)


@contextlib.contextmanager
def building(size: int) -> Iterator[None]:
    """Layers built inside shard for ``size`` ranks: a one-rank model built in a process
    that is a rank of a tensor-parallel engine is built whole (every choice a layer makes
    between one rank and several is made when it is built)."""
    global _state
    previous = _state
    if size == 1 and previous.size > 1:
        _state = TensorParallel()
    elif size != previous.size:
        raise RuntimeError(
            f"building a model for {size} tensor-parallel ranks in a process of a group of "
            f"{previous.size}"
        )
    try:
        yield
    finally:
        _state = previous


def init_distributed(
    rank: int, size: int, init_method: str, backend: str, timeout_s: float = 600.0
) -> None:
    """Join the process group of ``size`` ranks at ``init_method`` (``tcp://host:port``)
    as ``rank``, with ``backend`` (``gloo``, ``nccl``), and record the rank."""
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    set_tensor_parallel(rank, size)


def destroy_distributed() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place; ``x`` itself with one rank)."""
    if _state.size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, rank 0 first (``x`` with one rank)."""
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous())
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
