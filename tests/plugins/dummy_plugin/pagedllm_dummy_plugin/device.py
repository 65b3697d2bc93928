"""A device: the host CPU under another name, with its own attention backend."""

from __future__ import annotations

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import Device, KVCacheMemory


# [docs:device]
class DummyDevice(Device):
    """Runs on the host CPU under another name; never chosen by --device auto."""

    name = "dummydev"
    priority = -10  # --device auto prefers every built-in device
    runs_models = True
    default_block_size = 32
    attention_backend = "dummy_attn"  # registered by the same plugin
    # The KV cache gets a fixed size, so --gpu-memory-utilization is refused.
    uses_gpu_memory_utilization = False

    @classmethod
    def unavailable_reason(cls):
        # A real device imports its vendor library here, lazily, and says what is missing.
        return None

    def torch_device(self):
        return torch.device("cpu")

    def memory_info(self):
        return 1 << 30, 2 << 30

    def kv_cache_memory(self, cache_config):
        return KVCacheMemory(256 << 20, "the dummy device's fixed 256 MiB")

    def check_and_update_config(self, config):
        # Before the configuration is frozen: refuse (or adjust) what the device cannot run.
        if config.parallel_config.ranks > 1:
            raise ConfigError("the dummydev device runs one rank: leave out -tp and -pp")


# [/docs:device]
