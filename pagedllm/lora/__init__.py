"""LoRA adapters (``--enable-lora``): requests name an adapter with :class:`LoRARequest`."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
