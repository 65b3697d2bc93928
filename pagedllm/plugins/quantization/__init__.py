"""Built-in quantization methods (``--quantization``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_quantization_methods(registry):
    registry.add("gguf", "pagedllm.plugins.quantization.gguf:GGUFConfig")
    registry.add("fp8", "pagedllm.plugins.quantization.fp8:Fp8Config")
    registry.add("fbgemm_fp8", "pagedllm.plugins.quantization.fp8:FbgemmFp8Config")
