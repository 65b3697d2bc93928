"""Intel GPUs through PyTorch's XPU backend."""

from __future__ import annotations

from typing import Any

from pagedllm.core.interfaces import Device


class XpuDevice(Device):
    name = "xpu"
    priority = 90
    runs_models = False
    default_block_size = 64

    @classmethod
    def unavailable_reason(cls) -> str | None:
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return f"this PyTorch build ({torch.__version__}) has no XPU support"
        if not xpu.is_available():
            return "no Intel XPU is visible (torch.xpu.is_available() is False)"
        return None

    def torch_device(self):
        import torch

        return torch.device("xpu")

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.xpu.mem_get_info()

    def describe(self) -> dict[str, Any]:
        import torch

        return {
            "name": self.name,
            "devices": [torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())],
        }
