"""Google TPUs through torch_xla (detected only; no model runner yet)."""

from __future__ import annotations

import importlib.util
from typing import Any

from pagedllm.core.interfaces import Device


class TpuDevice(Device):
    name = "tpu"
    priority = 80
    runs_models = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_xla") is None:
            return "torch_xla is not installed"
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return f"torch_xla sees no TPU (device type {xr.device_type()!r})"
        return None

    def torch_device(self):
        import torch_xla.core.xla_model as xm

        return xm.xla_device()

    def memory_info(self) -> tuple[int, int]:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(self.torch_device())
        total = int(info["bytes_limit"])
        return total - int(info["bytes_used"]), total

    def describe(self) -> dict[str, Any]:
        import torch_xla

        return {"name": self.name, "torch_xla": torch_xla.__version__}
