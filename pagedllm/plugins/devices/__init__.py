"""Built-in devices. Targets are lazy strings: no vendor library is imported here."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_devices(registry):
    registry.add("cpu", "pagedllm.plugins.devices.cpu:CpuDevice")
    registry.add("cuda", "pagedllm.plugins.devices.cuda:CudaDevice")
    registry.add("xpu", "pagedllm.plugins.devices.xpu:XpuDevice")
    registry.add("neuron", "pagedllm.plugins.devices.neuron:NeuronDevice")
    registry.add("tpu", "pagedllm.plugins.devices.tpu:TpuDevice")


@hookimpl
def pagedllm_register_attention_backends(registry):
    # Plain torch (SDPA) over the paged cache; runs wherever torch does.
    registry.add("torch_sdpa", "pagedllm.core.attention.torch_backend:TorchSDPABackend")
    # The cpu device's: a paged-attention C kernel for decodes, SDPA for long prefills.
    registry.add("cpu_paged", "pagedllm.plugins.devices.cpu_attention:CpuPagedBackend")
    # The cuda device's: Triton kernels (on CPU tensors too, under TRITON_INTERPRET=1).
    registry.add("triton_paged", "pagedllm.plugins.devices.cuda_attention:TritonPagedBackend")
