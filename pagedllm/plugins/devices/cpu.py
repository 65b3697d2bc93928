"""The CPU device: always available, runs every model pagedllm supports."""

from __future__ import annotations

import functools
import os
import platform
from typing import TYPE_CHECKING, Any

from pagedllm.core.interfaces import Device, KVCacheMemory

if TYPE_CHECKING:
    from pagedllm.core.config import CacheConfig, PagedLLMConfig


class CpuDevice(Device):
    """The host CPU. The KV cache lives in host memory beside everything else, so it gets
    a fixed size (``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB) rather than a fraction of memory."""

    name = "cpu"
    priority = 0
    runs_models = True
    default_block_size = 16
    # Measured (2-core EPYC, default model, bench serve c=8 random 128/128): 512 instead of
    # 2048 took the median time to first token from 1.6 s to 1.0 s at the same throughput.
    server_step_tokens = 512
    attention_backend = "cpu_paged"
    uses_gpu_memory_utilization = False
    runs_data_parallel = True
    releases_memory = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def torch_device(self):
        import torch

        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def check_and_update_config(self, config: PagedLLMConfig) -> None:
        """The KV cache's space: ``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB (4 when unset)."""
        from pagedllm.core.config import cpu_kvcache_space_gib

        config.cache_config.cpu_kvcache_space_gib = cpu_kvcache_space_gib()

    def kv_cache_memory(self, cache_config: CacheConfig) -> KVCacheMemory:
        from pagedllm.core.config import ENV_CPU_KVCACHE_SPACE

        space = cache_config.cpu_kvcache_space_gib
        return KVCacheMemory(int(space * 2**30), f"{ENV_CPU_KVCACHE_SPACE}={space:g} GiB")

    def num_threads(self) -> int:
        """Torch's choice (``OMP_NUM_THREADS``, else one per physical core), but never
        more than the CPUs this process may run on (``taskset``, a container's cpuset):
        more threads than that only take turns on the same cores."""
        import torch

        threads = torch.get_num_threads()
        try:
            return max(1, min(threads, len(os.sched_getaffinity(0))))
        except AttributeError:  # no sched_getaffinity (macOS)
            return threads

    def prepare_process(self) -> None:
        tune_malloc()

    def release_startup_memory(self) -> None:
        trim_malloc()

    def release_memory(self, storages: list[Any], save: Any) -> int:
        from pagedllm.plugins.devices.cpu_memory import release

        released = release(storages, save)
        trim_malloc()
        return released

    def restore_memory(self, storages: list[Any], source: Any) -> None:
        from pagedllm.plugins.devices.cpu_memory import restore

        restore(storages, source)

    def describe(self) -> dict[str, Any]:
        import torch

        free, total = self.memory_info()
        return {
            "name": self.name,
            "processor": _cpu_model() or platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "memory_total_gib": round(total / 2**30, 1),
            "memory_available_gib": round(free / 2**30, 1),
            "isa": torch.backends.cpu.get_cpu_capability(),
        }

    def auto_dtype(self, dtype):
        """For float16 (the rule's type for float32 and float16 checkpoints): bfloat16
        on CPUs with bfloat16 arithmetic (as vLLM's CPU backend runs them), even where
        the CPU computes in float16 too, because pagedllm's CPU kernels (attention,
        the native layer, the 8-bit GGUF products) compute in bfloat16 and float32
        only: on an AVX512-FP16 Xeon the default GGUF model gave 1116 total tok/s
        offline in bfloat16 against 408 in float16, and decoded 2.6x faster at batch 1.
        Else float16 where the CPU computes in it, else float32. A bfloat16 checkpoint
        stays bfloat16 where the CPU computes in it."""
        import torch

        if dtype == torch.float16 and native_arithmetic(torch.bfloat16):
            return torch.bfloat16
        if native_arithmetic(dtype):
            return dtype
        return torch.float32


# Half-precision matmuls run at speed only where the CPU computes in that type; elsewhere
# they are emulated. Measured on an AVX512-BF16 EPYC: a float16 GEMM of 64 rows took 4.5x
# as long as float32, and the GGUF default model decoded 4x slower in float16 than in
# float32 (whose row kernels it also uses).
_NATIVE_FLAGS = {
    "torch.float16": frozenset({"avx512_fp16", "amx_fp16"}),
    "torch.bfloat16": frozenset({"avx512_bf16", "amx_bf16"}),
}


def native_arithmetic(dtype: Any) -> bool:
    """Whether this CPU computes in ``dtype`` natively (True for float32)."""
    native = _NATIVE_FLAGS.get(str(dtype))
    return native is None or bool(native & _cpu_flags())


@functools.cache
def _cpu_flags() -> frozenset[str]:
    from pagedllm.kernels.native import cpu_flags

    return frozenset(cpu_flags().split())


def _cpu_model() -> str | None:
    from pagedllm.kernels.native import cpuinfo_field

    return cpuinfo_field("model name")


ENV_MALLOC_TUNING = "PAGEDLLM_CPU_MALLOC_TUNING"
# glibc's mallopt parameters, and the value given to both thresholds.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MALLOC_KEEP_BYTES = 1 << 30


@functools.cache
def tune_malloc() -> bool:
    """Keep large freed buffers in the process for the next step (glibc): up to 1 GiB per
    allocation from the heap instead of a fresh mapping, and up to 1 GiB of free heap kept
    rather than given back. Without it every step's large activations (a prefill of 8192
    tokens: 50 MB outputs) are new mappings whose pages the kernel faults in and zeroes
    again: measured on a 2-core EPYC, a 8192 x 576 by 3072 x 576 GGUF product took 72 ms
    instead of 50, and 64 prompts of 128 tokens with 128 new ones 15.5 s instead of 14.1.
    The memory stays with the process at its high-water mark (as a caching allocator's
    would). The threads allocate from one heap (glibc's MALLOC_ARENA_MAX=1, unless that is
    set): each thread's own heap would keep its freed buffers apart from the others' (the
    default model's idle server: 381 -> 376 MiB resident). Not done where glibc's own
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set, with
    PAGEDLLM_CPU_MALLOC_TUNING=0, or without glibc. Whether it was done."""
    import logging

    if os.environ.get(ENV_MALLOC_TUNING, "1") == "0":
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = all(
        libc.mallopt(param, MALLOC_KEEP_BYTES) == 1
        for param in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
    )
    if done and "MALLOC_ARENA_MAX" not in os.environ:
        done = libc.mallopt(_M_ARENA_MAX, 1) == 1
    logging.getLogger("pagedllm.cpu").debug("malloc keeps large buffers: %s", done)
    return done


def trim_malloc() -> bool:
    """Return the free pages of glibc's heaps to the system (``malloc_trim``): with
    :func:`tune_malloc`'s threshold, what start-up freed (the tokenizer's parse, the
    weights' loading) would otherwise stay resident for the server's life, 5 MiB of the
    default model's start. Whether glibc released any."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def _glibc() -> Any:
    """The C library of the process (a ``ctypes.CDLL``) when it is glibc, else None."""
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError, AttributeError):  # not glibc
        return None
    return ctypes.CDLL(None)
