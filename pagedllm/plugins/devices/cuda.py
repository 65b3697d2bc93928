"""NVIDIA GPUs through PyTorch's CUDA build.

The KV cache takes what ``--gpu-memory-utilization`` leaves of the GPU's memory after the
peak of a profiled step (weights and the activations of a step of
``--max-num-batched-tokens`` tokens) and the memory held outside PyTorch. Attention runs
in Triton (:mod:`pagedllm.plugins.devices.cuda_attention`); decode steps are replayed
from CUDA graphs (:mod:`pagedllm.plugins.devices.cuda_graphs`) unless ``--enforce-eager``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.interfaces import Device, KVCacheMemory

if TYPE_CHECKING:
    from pagedllm.core.config import CacheConfig

logger = logging.getLogger(__name__)


class CudaDevice(Device):
    name = "cuda"
    priority = 100
    runs_models = True
    default_block_size = 16
    attention_backend = "triton_paged"
    captures_graphs = True

    def __init__(self) -> None:
        # Set by measure_peak_memory: weights and a largest step's activations.
        self.peak_bytes: int | None = None

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

    def measure_peak_memory(self, run: Callable[[], Any]) -> int | None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        excluded = int(run() or 0)
        torch.cuda.synchronize()
        self.peak_bytes = torch.cuda.max_memory_allocated() - excluded
        torch.cuda.empty_cache()
        return self.peak_bytes

    def kv_cache_memory(self, cache_config: CacheConfig) -> KVCacheMemory:
        import torch

        fraction = cache_config.gpu_memory_utilization
        source = f"--gpu-memory-utilization={fraction}"
        free, total = self.memory_info()
        if self.peak_bytes is None:
            return KVCacheMemory(int(min(free, total * fraction)), source)
        # Memory this process does not hold through PyTorch's allocator (the CUDA context,
        # libraries' workspaces) and other processes' memory on the GPU.
        outside = max(0, (total - free) - torch.cuda.memory_reserved())
        budget = total * fraction - self.peak_bytes - outside
        gib = 2**30
        detail = (
            f"{source} of {total / gib:.1f} GiB, less a profiled peak of "
            f"{self.peak_bytes / gib:.2f} GiB (weights and activations) and "
            f"{outside / gib:.2f} GiB held outside PyTorch"
        )
        return KVCacheMemory(max(0, int(min(budget, free))), detail)

    def decode_graphs(self, runner: Any, config: Any) -> Any:
        from pagedllm.plugins.devices.cuda_graphs import decode_graphs

        return decode_graphs(runner, config, use_graphs=True)

    def auto_dtype(self, dtype):
        """bfloat16 where the GPU computes in it (compute capability 8.0 and later),
        else float16."""
        import torch

        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.float16
        return dtype

    def describe(self) -> dict[str, Any]:
        import torch

        return {
            "name": self.name,
            "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        }
