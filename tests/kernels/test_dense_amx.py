"""The AMX product of many bfloat16 rows with a dense bfloat16 weight (csrc/dense_amx.c):
against torch, each row's result independent of the rest of the call and of the thread
count, the dispatch of ``batch_invariant.linear`` to it (batched decode steps, logits),
and the fallback to the GEMM where it does not apply (other dtypes, shapes, row counts,
batch-invariant mode, CPUs without AMX)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.batch_invariant import batch_invariant_mode, linear, unavailable_reason
from pagedllm.kernels.dense_amx import AMX_ROWS, amx_kernels, amx_linear
from pagedllm.kernels.dense_cpu import gemm_linear, small_linear, widened_linear

needs_amx = pytest.mark.skipif(
    amx_kernels() is None or not amx_kernels().available, reason="no AMX on this CPU"
)

# (n, k): one 16-row weight half past the 32-row groups, a long k; rows: one block, odd
# counts past each 16-row block and 32-row pair, the range's ends.
SHAPES = [(48, 64), (960, 576), (80, 1536)]
ROWS = [1, AMX_ROWS.start, 9, 17, 33, 64, 100, AMX_ROWS[-1]]


@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_torch(n, k):
    kernels = amx_kernels()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        expected = F.linear(x.double(), w.double())
        wide = kernels.matmul(x, w, out_dtype=torch.float32)
        assert wide.dtype == torch.float32 and wide.shape == (m, n)
        torch.testing.assert_close(wide.double(), expected, rtol=1e-5, atol=1e-4)
        # bfloat16 out: the float32 sums rounded once, to nearest even
        out = kernels.matmul(x, w)
        assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16())


@needs_amx
def test_a_row_ignores_the_others_and_the_threads():
    kernels = amx_kernels()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g).bfloat16()
    wide = torch.randn(40, 160, generator=g).bfloat16()
    rows = wide[:, :128]  # (a row stride past k)
    together = kernels.matmul(rows, w)
    for i in (0, 17, 39):
        assert torch.equal(kernels.matmul(rows[i : i + 1].contiguous(), w)[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.matmul(rows, w), together)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_linear_takes_the_kernel_for_batched_bfloat16_rows():
    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(64).bfloat16()
    x = torch.randn(4, 16, 96, generator=g).bfloat16()  # (64 rows)
    direct = amx_kernels().matmul(x.reshape(-1, 96), w).reshape(4, 16, 64)
    assert torch.equal(linear(x, w), direct)
    assert torch.equal(linear(x, w, bias), direct + bias)
    torch.testing.assert_close(linear(x, w).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    # (the logits: a tied head's product)
    head = torch.randn(512, 96, generator=g).bfloat16()
    assert torch.equal(linear(x[0], head), amx_kernels().matmul(x[0], head))


@needs_amx
def test_batch_invariant_mode_keeps_the_panels():
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    from pagedllm.kernels.gguf_cpu import cpu_kernels

    if not cpu_kernels().bf16:
        pytest.skip("no bfloat16 panels on this CPU")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(20, 96, generator=g).bfloat16()
    with batch_invariant_mode():
        out = linear(x, w)
    assert torch.equal(out, cpu_kernels().matmul_dense(x, w, out_dtype=torch.bfloat16))
    # (one row alone gives the same bits there)
    with batch_invariant_mode():
        assert torch.equal(linear(x[:1], w)[0], out[0])


def test_falls_back_where_it_does_not_apply():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g).bfloat16()
    w = torch.randn(64, 96, generator=g).bfloat16()
    cases = [
        (x.float(), w.float()),  # float32: the GEMM (AMX tiles multiply bfloat16)
        (x[:, :80], w[:, :80].contiguous()),  # k not a multiple of 32
        (x, w[:40].contiguous()),  # n not a multiple of 16
        (x, w.t().contiguous().t()),  # a strided weight
        (x[: AMX_ROWS.start - 1], w),  # 1-3 rows: the small-row kernel's
        (torch.randn(AMX_ROWS[-1] + 1, 96, generator=g).bfloat16(), w),  # many: the GEMM's
    ]
    for xs, ws in cases:
        assert amx_linear(xs, ws) is None
    for xs, ws in cases[:4] + cases[5:]:
        # (the GEMM (oneDNN's for float32), the small-row kernel where it takes the rows,
        # or on CPUs with its AVX2 tiles the float32 GEMM on widened bfloat16 rows)
        other = small_linear(xs, ws)
        other = widened_linear(xs, ws) if other is None else other
        assert torch.equal(linear(xs, ws), gemm_linear(xs, ws) if other is None else other)
    if amx_kernels() is None or not amx_kernels().available:
        assert amx_linear(x, w) is None


def test_refuses_other_output_dtypes():
    kernels = amx_kernels()
    if kernels is None or not kernels.available:
        pytest.skip("no AMX on this CPU")
    x = torch.ones(16, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        kernels.matmul(x, torch.ones(16, 32, dtype=torch.bfloat16), out_dtype=torch.float16)
