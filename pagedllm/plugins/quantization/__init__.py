"""Built-in quantization methods (``--quantization``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_quantization_methods(registry):
    registry.add("gguf", "pagedllm.plugins.quantization.gguf:GGUFConfig")
    registry.add("fp8", "pagedllm.plugins.quantization.fp8:Fp8Config")
    registry.add("fbgemm_fp8", "pagedllm.plugins.quantization.fp8:FbgemmFp8Config")
    registry.add("gptq", "pagedllm.plugins.quantization.int4:GPTQConfig")
    registry.add("gptq_marlin", "pagedllm.plugins.quantization.int4:GPTQMarlinConfig")
    registry.add("awq", "pagedllm.plugins.quantization.int4:AWQConfig")
    registry.add("bitsandbytes", "pagedllm.plugins.quantization.bitsandbytes:BitsAndBytesConfig")
    registry.add("awq_marlin", "pagedllm.plugins.quantization.int4:AWQMarlinConfig")
    registry.add(
        "compressed-tensors",
        "pagedllm.plugins.quantization.compressed_tensors:CompressedTensorsConfig",
    )
