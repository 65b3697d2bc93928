from pagedllm.core.interfaces import Device


class DummyDevice(Device):
    """Runs on the host CPU under another name; never chosen by --device auto."""

    name = "dummydev"
    priority = -10
    runs_models = True
    default_block_size = 32
    attention_backend = "dummy_attn"

    @classmethod
    def unavailable_reason(cls):
        return None

    def torch_device(self):
        import torch

        return torch.device("cpu")

    def memory_info(self):
        return 1 << 30, 2 << 30
