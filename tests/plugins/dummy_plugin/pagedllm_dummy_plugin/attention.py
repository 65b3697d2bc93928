from pagedllm.core.attention.torch_backend import TorchSDPABackend


class CountingBackend(TorchSDPABackend):
    """The reference backend, counting the layer calls it serves."""

    name = "dummy_attn"
    calls = 0

    def forward(self, layer, query, key, value, metadata):
        type(self).calls += 1
        return super().forward(layer, query, key, value, metadata)
