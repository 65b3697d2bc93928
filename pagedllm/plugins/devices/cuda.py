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

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import Device, KVCacheMemory

if TYPE_CHECKING:
    from pagedllm.core.config import CacheConfig, PagedLLMConfig

logger = logging.getLogger(__name__)


class CudaDevice(Device):
    name = "cuda"
    priority = 100
    runs_models = True
    default_block_size = 16
    attention_backend = "triton_paged"
    captures_graphs = True
    runs_data_parallel = True

    def __init__(self) -> None:
        # Set by measure_peak_memory: weights and a largest step's activations.
        self.peak_bytes: int | None = None
        # GPU memory free before this process loaded anything (prepare_process).
        self.free_at_start: int | None = None

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

    def check_and_update_config(self, config: PagedLLMConfig) -> None:
        """One GPU per rank: -tp x -pp of them, for each data-parallel replica on this node."""
        import torch

        parallel = config.parallel_config
        ranks, visible = parallel.ranks, torch.cuda.device_count()
        if ranks > 1 and visible < ranks:
            raise ConfigError(f"{parallel.sizes_flag()} needs {ranks} GPUs; {visible} are visible")
        here = parallel.local_replicas
        if parallel.data_parallel_size > 1 and visible < here * ranks:
            raise ConfigError(
                f"{here} data-parallel replicas on this node with {ranks} rank(s) per "
                f"replica (-tp x -pp) need {here * ranks} GPUs; {visible} are visible"
            )

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info()

    def prepare_process(self) -> None:
        """Note the GPU's free memory before the model loads: what other processes hold
        then is theirs, not this engine's to budget."""
        import torch

        if self.free_at_start is None:  # (not again for a draft model)
            torch.cuda.init()
            self.free_at_start = torch.cuda.mem_get_info()[0]

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

        if self.peak_bytes is None or self.free_at_start is None:
            return super().kv_cache_memory(cache_config)
        free, total = self.memory_info()
        return kv_cache_budget(
            cache_config.gpu_memory_utilization,
            total,
            self.free_at_start,
            free,
            torch.cuda.memory_reserved(),
            self.peak_bytes,
        )

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


def kv_cache_budget(
    fraction: float, total: int, free_at_start: int, free_now: int, reserved: int, peak: int
) -> KVCacheMemory:
    """The KV cache's bytes on a GPU of ``total`` bytes: this engine may hold ``fraction``
    of it, of which the profiled ``peak`` (weights and a largest step's activations) and
    what this process holds outside PyTorch's allocator (``free_at_start - free_now``
    less the allocator's ``reserved`` bytes: cuBLAS workspaces, ...) are taken. Memory
    other processes held at start is theirs: when less than the fraction is free then, a
    ConfigError says so (as vLLM's)."""
    gib = 2**30
    source = f"--gpu-memory-utilization={fraction}"
    wanted = total * fraction
    if free_at_start < wanted:
        raise ConfigError(
            f"{source} asks for {wanted / gib:.2f} GiB of the GPU's {total / gib:.2f} GiB, but "
            f"only {free_at_start / gib:.2f} GiB were free when the engine started (other "
            f"processes hold the rest): lower --gpu-memory-utilization or free the GPU"
        )
    outside = max(0, (free_at_start - free_now) - reserved)
    detail = (
        f"{source} of {total / gib:.1f} GiB, less a profiled peak of {peak / gib:.2f} GiB "
        f"(weights and activations) and {outside / gib:.2f} GiB held outside PyTorch"
    )
    return KVCacheMemory(max(0, int(min(wanted - peak - outside, free_now))), detail)
