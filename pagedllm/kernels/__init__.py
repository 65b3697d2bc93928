"""Numerical ops. Every op has a plain torch reference here; faster kernels (Triton for
GPUs) are tested against the reference."""


def decoded_by_triton(weight) -> bool:
    """Whether a packed ``weight`` (a torch tensor) is on a GPU, where the Triton kernels
    decode it (triton is imported only then)."""
    if weight.device.type != "cuda":
        return False
    from pagedllm.kernels.triton_gguf import triton_available

    return triton_available()
