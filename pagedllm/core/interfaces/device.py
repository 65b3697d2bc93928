"""The Device extension point: where a model runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class Device(ABC):
    """A kind of hardware pagedllm can run a model on.

    Contract:
    - Importing the module that defines a device must not import its vendor libraries
      (``torch_xla``, ``torch_neuronx``, ...); :meth:`unavailable_reason` may, lazily.
    - ``--device auto`` picks the available device with the highest ``priority``.
    - ``runs_models`` says whether pagedllm has a model runner for this device; a device
      can be detected (and listed by ``collect-env``) before it can run a model.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    runs_models: ClassVar[bool] = False
    # --block-size when the user gives none.
    default_block_size: ClassVar[int] = 16
    # The registered attention backend this device runs models with.
    attention_backend: ClassVar[str] = "torch_sdpa"

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

    def describe(self) -> dict[str, Any]:
        """Facts for ``pagedllm collect-env`` (name, count, versions, ...)."""
        return {"name": self.name}

    def auto_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype ``--dtype auto`` runs in, given the one the checkpoint rule picked
        (FP16 or BF16). A device without fast arithmetic in it may choose another."""
        return dtype
