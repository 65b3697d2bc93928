"""Pieces shared by the model implementations: norms, activations, weight loading."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.kernels.norms import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ConfigError(f"activation {name!r} is not supported")
    return ACT2FN[name]


def copy_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Any = None,
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Copy ``(name, tensor)`` pairs into same-named parameters.

    ``rename(name)`` maps a checkpoint name to a parameter name (or None to drop it);
    names containing any of ``skip`` are ignored. An unknown name or a shape mismatch is
    an error naming the tensor.
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
            raise ConfigError(f"the checkpoint has a weight {name!r} this model does not know")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(target)
    return loaded


def layer_sliding_windows(config: Any, disable_sliding_window: bool = False) -> list[int | None]:
    """The sliding window of each layer (None = full attention)."""
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if disable_sliding_window or not window:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [window] * num_layers
