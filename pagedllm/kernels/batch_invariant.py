"""Batch-invariant mode (``--batch-invariant``): every row of a step computed the same way
whatever else the step holds, so a request's tokens and logprobs are bit-identical alone
or among any others.

A product's result for one row changes with the batch when the kernel, or its order of
summation, is chosen by the number of rows: the BLAS GEMMs behind ``F.linear`` do so, and
so do the GGUF kernels (row kernels for a few rows, panels for more; 8-bit activations
from some row count on). While the mode is on (:func:`batch_invariant_mode`, which the
model runner enters for each step it computes), products take the panel kernels of
``csrc/gguf_cpu.c`` at every row count, one row included: each output is one chain of
multiply-adds over the input features in order, whatever rows share the call. Dense
weights go through the same panels (:func:`linear`). Norms, RoPE, SiLU and the sampler's
softmax work row by row already; the cpu device's attention kernel attends each query
token over its context in a fixed order of chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pagedllm.kernels.dense_amx import amx_linear
from pagedllm.kernels.dense_cpu import gemm_linear, small_linear, widened_linear
from pagedllm.kernels.gguf_cpu import cpu_kernels

__all__ = ["batch_invariant", "batch_invariant_mode", "linear", "unavailable_reason"]

# The mode of the step being computed: a module global, which torch.compile reads as a
# guarded constant (a ContextVar would break its graphs). One engine computes steps at a
# time per process, on its engine thread.
_MODE = [False]


def batch_invariant() -> bool:
    """Whether the step being computed is in batch-invariant mode."""
    return _MODE[0]


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Computes within the block in batch-invariant mode (or not: ``enabled=False``)."""
    previous, _MODE[0] = _MODE[0], enabled
    try:
        yield
    finally:
        _MODE[0] = previous


def unavailable_reason() -> str | None:
    """Why this machine cannot compute products batch-invariantly, or None: the panel
    kernels need the compiled CPU kernels on a CPU with AVX-512, or AVX2 with FMA."""
    kernels = cpu_kernels()
    if kernels is None:
        return "the compiled CPU kernels are not available (no C compiler, or disabled)"
    if not kernels.row_tiles:
        return "this CPU has neither AVX-512 nor AVX2 with FMA, which the panel products need"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: for a few CPU rows of float32 or bfloat16 (decode
    steps) the small-row kernel of :mod:`pagedllm.kernels.dense_cpu`, but bfloat16 rows from
    four up (batched decodes) :mod:`pagedllm.kernels.dense_amx`'s on CPUs with AMX, and more
    bfloat16 rows than the small-row kernel takes widened for the float32 GEMM on CPUs with
    its AVX2 tiles (no AVX-512: torch's bfloat16 GEMM has no vector path there), more float32
    rows by oneDNN's GEMM (:func:`pagedllm.kernels.dense_cpu.gemm_linear`), the bias added
    after (the native decoder layer calls the same kernels); in batch-invariant mode, for CPU
    tensors, the panel product (bfloat16 activations with a bfloat16 weight in bfloat16
    pairs on CPUs with AVX512-BF16, else in float32 on the exact widening, rounded once to
    ``x``'s dtype)."""
    if not _MODE[0]:
        out = None
        if x.device.type == "cpu":
            out = amx_linear(x, weight)
            if out is None:
                out = small_linear(x, weight)
            if out is None:
                out = widened_linear(x, weight)
        if out is None:
            return gemm_linear(x, weight, bias)
        if bias is not None:
            out += bias.to(out.dtype)
        return out
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError(f"batch-invariant products: {unavailable_reason()}")
    flat = x.reshape(-1, x.shape[-1])
    if weight.dtype not in (torch.float32, torch.bfloat16):
        weight = weight.float()
    out = None
    if flat.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        out = kernels.matmul_dense(flat, weight, out_dtype=torch.bfloat16)
    if out is None:
        out = kernels.matmul_dense(flat.float(), weight)
        if out is None:
            raise RuntimeError(f"batch-invariant products: {unavailable_reason()}")
    out = out.to(x.dtype)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
