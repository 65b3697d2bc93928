"""Built-in quantization methods (``--quantization``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_quantization_methods(registry):
    registry.add("gguf", "pagedllm.plugins.quantization.gguf:GGUFConfig")
