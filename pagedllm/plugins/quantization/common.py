"""What the built-in quantization methods share."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def checkpoint_param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """An empty, frozen parameter of ``shape`` for the loader to fill with a checkpoint
    tensor of that name."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def left_in_floats(prefix: str, ignored: Iterable[str]) -> bool:
    """Whether the linear layer at ``prefix`` stays in floats: the vocabulary head, and
    the layers a checkpoint lists (``ignored_layers``, ``modules_to_not_convert``) by name
    or part of a name, as transformers matches them."""
    if prefix == "lm_head" or prefix.endswith(".lm_head"):
        return True
    return any(name and name in prefix for name in ignored)
