"""The Device extension point: where a model runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import CacheConfig, PagedLLMConfig


class KVCacheMemory(NamedTuple):
    """The memory a device gives the KV cache, and the setting that decided it."""

    num_bytes: int
    # The setting as an error message names it, e.g. "--gpu-memory-utilization=0.9".
    source: str


class Device(ABC):
    """A kind of hardware pagedllm can run a model on.

    Contract:
    - Importing the module that defines a device must not import its vendor libraries
      (``torch_xla``, ``torch_neuronx``, ...); :meth:`unavailable_reason` may, lazily.
    - ``--device auto`` picks the available device with the highest ``priority``.
    - ``runs_models`` says whether pagedllm has a model runner for this device; a device
      can be detected (and listed by ``collect-env``) before it can run a model.
    - :meth:`kv_cache_memory` says how much memory the KV cache gets (unless
      ``--num-gpu-blocks-override`` fixes the block count); ``uses_gpu_memory_utilization``
      says whether ``--gpu-memory-utilization`` takes part (if not, setting it is refused).
    - :meth:`num_threads` is the number of CPU threads the model computes with; the
      engine sets torch's intra-op thread count to it when it loads a model.
    - :meth:`measure_peak_memory` lets a device size its KV cache from a profiled step:
      the engine calls it once, before the cache exists, with a step of the largest size.
    - :meth:`decode_graphs` may return a replayer of decode steps (CUDA graphs); the
      model runner hands it the steps it covers and runs the others eagerly.
    - :meth:`check_and_update_config` sees the configuration before it is frozen: the
      device refuses (``ConfigError``) what it cannot run, or adjusts it.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    runs_models: ClassVar[bool] = False
    # --block-size when the user gives none.
    default_block_size: ClassVar[int] = 16
    # Tokens per step of a server whose --max-num-batched-tokens is not given (with chunked
    # prefill); None: the entry point's default. A slow device takes prompts in smaller
    # chunks, so the first of several arriving together gets its first token sooner.
    server_step_tokens: ClassVar[int | None] = None
    # The registered attention backend this device runs models with.
    attention_backend: ClassVar[str] = "torch_sdpa"
    # Whether kv_cache_memory reads --gpu-memory-utilization.
    uses_gpu_memory_utilization: ClassVar[bool] = True
    # Whether decode_graphs captures graphs (--cuda-graph-sizes and
    # --max-seq-len-to-capture take part; elsewhere setting them is refused).
    captures_graphs: ClassVar[bool] = False
    # Whether `pagedllm serve --data-parallel-size N` may run N replicas on it.
    runs_data_parallel: ClassVar[bool] = False
    # Whether release_memory / restore_memory are built (else --enable-sleep-mode is
    # refused on this device).
    releases_memory: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when this device can be used here, else why it cannot (one sentence)."""

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @abstractmethod
    def torch_device(self) -> torch.device:
        """The ``torch.device`` tensors for this device are allocated on."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the memory the KV cache would live in."""

    def check_and_update_config(self, config: PagedLLMConfig) -> None:
        """Check the configuration against this device (raise ``ConfigError`` naming the
        option it cannot run) or adjust it (assign its fields; it is validated again and
        frozen after this). Called once per engine configuration, after the plugins'
        ``pagedllm_update_config``. The default changes nothing."""
        return None

    def kv_cache_memory(self, cache_config: CacheConfig) -> KVCacheMemory:
        """The bytes the KV cache may take. The default, for accelerators with their own
        memory: ``--gpu-memory-utilization`` of the total, at most what is free now
        (after the weights were loaded)."""
        free, total = self.memory_info()
        fraction = cache_config.gpu_memory_utilization
        return KVCacheMemory(
            int(min(free, total * fraction)), f"--gpu-memory-utilization={fraction}"
        )

    def measure_peak_memory(self, run: Callable[[], Any]) -> int | None:
        """The peak bytes of device memory this process holds while ``run()`` computes a
        step of the largest size the scheduler makes, less the bytes ``run()`` returns (its
        throwaway KV cache). ``None``, without calling ``run``: the device does not profile
        (the default), and :meth:`kv_cache_memory` decides alone."""
        return None

    def decode_graphs(self, runner: Any, config: Any) -> Any:
        """An object replaying decode steps for ``runner`` (a
        :class:`pagedllm.core.runner.ModelRunner` whose cache has one spare block,
        ``runner.pad_block``, for padding rows), with ``covers(num_decodes, max_context)``
        and ``run(token_ids, positions, context_lens, block_tables)`` returning the step's
        hidden states; or ``None`` (the default): every step runs eagerly. Called only
        when ``captures_graphs`` and not ``--enforce-eager``."""
        return None

    def num_threads(self) -> int:
        """CPU threads the model computes with. The default keeps torch's own choice
        (``OMP_NUM_THREADS``, else one per physical core): on an accelerator the host
        threads only feed it."""
        import torch

        return torch.get_num_threads()

    def prepare_process(self) -> None:
        """Settings of this process the device computes best with (allocator, ...), made
        once before the model is built. The default changes nothing."""
        return None

    def release_startup_memory(self) -> None:
        """Give back to the system what start-up allocated and freed (its parsing and
        loading buffers), once the model and the KV cache are built; the memory the
        steps use is kept. The default changes nothing."""
        return None

    def release_memory(self, storages: list[Any], save: BinaryIO | None) -> int:
        """Sleep mode: give the memory of ``storages`` (``torch.UntypedStorage``s of the
        model or the KV cache) back to the system while keeping their addresses (kernels
        and graphs hold raw pointers to them); with ``save``, first write their bytes to
        it, in order, for :meth:`restore_memory`. The bytes released (a storage the
        device cannot release stays as it is, and is not written). Only where
        ``releases_memory``."""
        raise NotImplementedError(f"the {self.name} device does not release memory")

    def restore_memory(self, storages: list[Any], source: BinaryIO | None) -> None:
        """Undo :meth:`release_memory` for the same ``storages`` (in the same order):
        their memory is usable again, and with ``source`` (what ``save`` got) it holds
        their bytes again; without, what it holds is undefined until written."""
        raise NotImplementedError(f"the {self.name} device does not release memory")

    def describe(self) -> dict[str, Any]:
        """Facts for ``pagedllm collect-env`` (name, count, versions, ...)."""
        return {"name": self.name}

    def auto_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype ``--dtype auto`` runs in, given the one the checkpoint rule picked
        (FP16 or BF16). A device without fast arithmetic in it may choose another."""
        return dtype
