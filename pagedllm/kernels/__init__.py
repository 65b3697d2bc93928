"""Numerical ops. Every op has a plain torch reference here; faster kernels (Triton for
GPUs) are tested against the reference."""


def decoded_by_triton(weight) -> bool:
    """Whether a packed ``weight`` (a torch tensor) is on a GPU, where the Triton kernels
    decode it (triton is imported only then)."""
    if weight.device.type != "cuda":
        return False
    from pagedllm.kernels.triton_gguf import triton_available

    return triton_available()


def triton_rows(x) -> bool:
    """Whether the cuda device's Triton kernels (``triton_attention``: RMSNorm with the
    residual add, RoPE, SiLU·mul) take ``x``: a GPU tensor of 2-D rows with a dense last
    dimension, outside ``torch.compile``'s tracing (which fuses those ops itself)."""
    if x.device.type != "cuda" or x.dim() != 2 or x.stride(-1) != 1:
        return False
    import torch

    if torch.compiler.is_compiling():
        return False
    from pagedllm.kernels.triton_attention import triton_available

    return triton_available()
