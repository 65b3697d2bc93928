"""NVIDIA GPUs through PyTorch's CUDA build."""

from __future__ import annotations

from typing import Any

from pagedllm.core.interfaces import Device


class CudaDevice(Device):
    name = "cuda"
    priority = 100
    # The model runner has not been validated on CUDA yet.
    runs_models = False
    default_block_size = 16
    attention_backend = "triton_paged"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        import torch

        if torch.version.cuda is None:
            return f"this PyTorch build ({torch.__version__}) has no CUDA support"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
        return None

    def torch_device(self):
        import torch

        return torch.device("cuda")

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info()

    def describe(self) -> dict[str, Any]:
        import torch

        return {
            "name": self.name,
            "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        }
