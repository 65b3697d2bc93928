from pagedllm.core.interfaces import LinearMethod, QuantizationConfig


class Int8RowLinearMethod(LinearMethod):
    """Symmetric int8 weights with one float scale per output row."""

    def create_weights(self, layer, input_size, output_size, params_dtype):
        import torch

        layer.qweight = torch.nn.Parameter(
            torch.zeros(output_size, input_size, dtype=torch.int8), requires_grad=False
        )
        layer.scale = torch.nn.Parameter(
            torch.ones(output_size, 1, dtype=params_dtype), requires_grad=False
        )

    def quantize_into(self, layer, weight):
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        layer.qweight.data.copy_((weight / scale).round().clamp(-127, 127).to(layer.qweight.dtype))
        layer.scale.data.copy_(scale)

    def apply(self, layer, x, bias=None):
        import torch

        weight = layer.qweight.to(x.dtype) * layer.scale.to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)


class Int8RowConfig(QuantizationConfig):
    name = "dummyq"

    def __init__(self, skip_prefixes=()):
        self.skip_prefixes = tuple(skip_prefixes)

    @classmethod
    def from_config(cls, config):
        unknown = set(config) - {"skip_prefixes"}
        if unknown:
            raise ValueError(f"dummyq does not understand {sorted(unknown)}")
        return cls(config.get("skip_prefixes", ()))

    def get_linear_method(self, layer, prefix):
        if prefix.startswith(self.skip_prefixes) and self.skip_prefixes:
            return None
        return Int8RowLinearMethod()
