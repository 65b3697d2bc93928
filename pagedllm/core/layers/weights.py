"""Checkpoint tensors into a built model's parameters: each parameter takes its name's
tensor (this rank's share of it where it holds a tensor-parallel shard), and the parts of
the model another rank holds (:class:`HeldElsewhere`) skip theirs. Shared by the model
architectures and the load formats that fill a model directly (a sharded state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.linear import rank_share

__all__ = ["HeldElsewhere", "copy_tensor", "copy_weights", "held_elsewhere"]


class HeldElsewhere(nn.Module):
    """A part of the model that another rank holds (another pipeline stage's layers,
    embedding, head or final norm; another tensor-parallel rank's per-head norms): no
    parameters, and its checkpoint tensors are skipped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this part of the model is held by another rank")


def held_elsewhere(module: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``module`` belongs to a part another rank holds (one
    of its enclosing modules is a :class:`HeldElsewhere`)."""
    owner: Any = module
    for part in name.split(".")[:-1]:
        owner = owner._modules.get(part) if isinstance(owner, nn.Module) else None
        if owner is None:
            return False
        if isinstance(owner, HeldElsewhere):
            return True
    return False


def copy_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Any = None,
    skip: tuple[str, ...] = (),
    shards: bool = True,
) -> set[str]:
    """Copy ``(name, tensor)`` pairs into same-named parameters.

    ``rename(name)`` maps a checkpoint name to a parameter name (or None to drop it);
    names containing any of ``skip`` are ignored. An unknown name or a shape mismatch is
    an error naming the tensor. A parameter holding a tensor-parallel shard
    (``tp_narrow = (dim, start, length)``, see ``pagedllm.core.layers.linear.mark_shard``)
    takes its slice of the full checkpoint tensor (:func:`rank_share`), unless ``shards``
    is False (the tensors are this rank's own already: a sharded state).
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        target = rename(name) if rename else name
        if target is None:
            continue
        param = params.get(target)
        if param is None:
            if held_elsewhere(module, target):
                continue
            raise ConfigError(f"the checkpoint has a weight {name!r} this model does not know")
        copy_tensor(param, tensor, name, shards=shards)
        loaded.add(target)
    return loaded


def copy_tensor(
    param: torch.Tensor, tensor: torch.Tensor, name: str, *, shards: bool = True
) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (this rank's share of it where
    ``param`` holds a tensor-parallel shard and ``shards``); a shape that does not fit is
    an error naming the tensor."""
    if shards:
        tensor = rank_share(param, tensor, name)
    if tuple(param.shape) != tuple(tensor.shape):
        if param.numel() == tensor.numel() == 1:  # a scalar saved as [] or [1]
            tensor = tensor.reshape(param.shape)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ConfigError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
