"""Host-to-device copies of a step's inputs.

On a CUDA device a tensor made from Python values is built in pinned (page-locked) host
memory and copied without blocking: the copy is queued on the current stream, ahead of
the kernels that read it, and the host goes on building the step instead of waiting for
the transfer. PyTorch's pinned allocator keeps the host buffer alive until the copy is
done. Elsewhere (the cpu) the tensor is made where it is used.
"""

from __future__ import annotations

from typing import Any

import torch


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def host_tensor(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, through pinned memory on CUDA."""
    if _is_cuda(device):
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host ``tensor`` on ``device``, through pinned memory on CUDA."""
    if _is_cuda(device) and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
