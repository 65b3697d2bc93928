"""The small-row product of dense float32 / bfloat16 weights (csrc/dense_cpu.c): against
torch on this machine's vector path, the plain C path (``portable``), and the AVX2 and
plain x86-64 builds of the same source; each row's result independent of the rest of the
call and of the thread count; and the dispatch of ``batch_invariant.linear`` to it."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.batch_invariant import linear
from pagedllm.kernels.dense_amx import amx_linear
from pagedllm.kernels.dense_cpu import (
    SMALL_ROWS_MAX,
    TILES_ROWS_MAX,
    DenseCpuKernels,
    dense_kernels,
    gemm_linear,
    small_linear,
    small_rows_max,
    widened_linear,
)
from pagedllm.kernels.native import load_kernel_library

pytestmark = pytest.mark.skipif(dense_kernels() is None, reason="no C compiler")

# (n, k): tails of every vector width (k % 32, k % 16, k % 8, odd k), n past and below one
# tile of 8 weight rows.
SHAPES = [(40, 576), (13, 100), (5, 33), (1000, 72), (3, 7)]
ROWS = [1, 2, 3, 5, 8, 16]


def _tolerance(dtype: torch.dtype, k: int) -> dict[str, float]:
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * k**0.5)
    # (a bfloat16 output: one rounding, 2^-8 relative, on top of float32 sums)
    return dict(rtol=1e-2, atol=1e-2)


def _check(kernels: DenseCpuKernels, dtype: torch.dtype, portable: bool = False) -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).to(dtype)
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            expected = F.linear(x.double(), w.double())
            out = kernels.matmul(x, w, portable=portable)
            assert out.dtype == dtype and out.shape == (m, n)
            torch.testing.assert_close(out.double(), expected, **_tolerance(dtype, k))
            # float32 out of bfloat16 rows: the sums unrounded
            if dtype == torch.bfloat16:
                wide = kernels.matmul(x, w, out_dtype=torch.float32, portable=portable)
                torch.testing.assert_close(wide.double(), expected, rtol=1e-5, atol=1e-4)
                assert torch.equal(wide.to(torch.bfloat16), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_matches_torch(dtype, portable):
    _check(dense_kernels(), dtype, portable)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builds_for_older_cpus_match_torch(march, dtype):
    """The AVX2 build (haswell) and the plain one (x86-64) of the same source, run here."""
    lib = load_kernel_library("dense_cpu", march=march)
    if lib is None:
        pytest.skip(f"no build for -march={march}")
    kernels = DenseCpuKernels(lib)
    assert kernels.simd == (march == "haswell") and not kernels.bf16
    assert kernels.tiles == (march == "haswell")
    _check(kernels, dtype)


def _kernels(build: str) -> DenseCpuKernels:
    if build == "native":
        return dense_kernels()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    lib = load_kernel_library("dense_cpu", march=build)
    if lib is None:
        pytest.skip(f"no build for -march={build}")
    return DenseCpuKernels(lib)


@pytest.mark.parametrize("build", ["native", "haswell"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows(build, dtype):
    """Rows past one block of the AVX2 tiles (192 KiB of float32 rows: 80 rows of 600
    here) and a tail of rows and of k: against torch, and each row's bits as when alone."""
    kernels = _kernels(build)
    assert kernels.tiles == (build == "haswell" or (kernels.simd and not _avx512()))
    g = torch.Generator().manual_seed(4)
    w = torch.randn(37, 603, generator=g).to(dtype)
    x = torch.randn(171, 603, generator=g).to(dtype)
    out = kernels.matmul(x, w)
    torch.testing.assert_close(
        out.double(), F.linear(x.double(), w.double()), **_tolerance(dtype, 603)
    )
    for i in (0, 79, 80, 81, 160, 170):
        assert torch.equal(kernels.matmul(x[i : i + 1], w)[0], out[i])


@pytest.mark.parametrize("build", ["native", "haswell"])
@pytest.mark.parametrize(
    "x_dtype, w_dtype, out_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
    ],
)
def test_packed_panels_give_the_tiles_bits(build, x_dtype, w_dtype, out_dtype):
    """From 48 rows the AVX2 build lays the weight out in panels of 16 rows (outer-product
    passes, one per lane of the tiles' chains): each row's bits are the tiles' (the row
    alone), whatever the rows' stride, the threads, a weight of k past one pass (2048) or
    a last panel of 5 rows, and more rows than one packing (1024)."""
    kernels = _kernels(build)
    g = torch.Generator().manual_seed(5)
    for n, k, m in [(37, 2100, 61), (16, 8, 48), (53, 603, 1030)]:
        w = torch.randn(n, k, generator=g).to(w_dtype)
        x = torch.randn(m, k + 5, generator=g).to(x_dtype)[:, :k]  # (a row stride past k)
        out = kernels.matmul(x, w, out_dtype=out_dtype)
        expected = F.linear(x.double(), w.double())
        torch.testing.assert_close(out.double(), expected, **_tolerance(out_dtype, k))
        for i in sorted({0, 5, 6, 47, m // 2, m - 1}):
            alone = kernels.matmul(x[i : i + 1].contiguous(), w, out_dtype=out_dtype)
            assert torch.equal(alone[0], out[i]), (n, k, m, i)
        assert torch.equal(_on_one_thread(kernels.matmul, x, w, out_dtype=out_dtype), out)


def _on_one_thread(fn, *args, **kwargs):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _avx512() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512f" in flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_mixed_rows_and_weights(dtype, portable):
    """float32 rows with a bfloat16 weight and the reverse: widened exactly."""
    g = torch.Generator().manual_seed(1)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    w, x = torch.randn(24, 80, generator=g).to(other), torch.randn(3, 80, generator=g).to(dtype)
    out = dense_kernels().matmul(x, w, out_dtype=torch.float32, portable=portable)
    expected = F.linear(x.double(), w.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_a_row_ignores_the_others_and_the_threads(dtype, portable):
    """Each output one fixed chain over k: a row alone, among others, in a strided buffer
    or on one thread gives the same bits (what the native layer's agreement rests on)."""
    kernels = dense_kernels()
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g).to(dtype)
    wide = torch.randn(7, 256, generator=g).to(dtype)
    rows = wide[:, :200]  # (a row stride past k)
    together = kernels.matmul(rows, w, portable=portable)
    for i in range(rows.shape[0]):
        alone = kernels.matmul(rows[i : i + 1].contiguous(), w, portable=portable)
        assert torch.equal(alone[0], together[i])
    assert torch.equal(_on_one_thread(kernels.matmul, rows, w, portable=portable), together)


def test_linear_takes_the_kernel_for_few_rows_only():
    g = torch.Generator().manual_seed(3)
    for dtype in SMALL_ROWS_MAX:
        limit = small_rows_max(dtype)
        assert limit == (TILES_ROWS_MAX if dense_kernels().tiles else SMALL_ROWS_MAX)[dtype]
        w, bias = torch.randn(64, 96, generator=g).to(dtype), torch.randn(64).to(dtype)
        x = torch.randn(2, limit, 96, generator=g).to(dtype)
        few = x[:1]
        assert torch.equal(linear(few, w), dense_kernels().matmul(few[0], w)[None])
        out = linear(few, w, bias)
        assert torch.equal(out, dense_kernels().matmul(few[0], w)[None] + bias)
        torch.testing.assert_close(out, F.linear(few, w, bias), **_tolerance(dtype, 96))
        # more rows than the limit, mixed dtypes or a strided weight: the GEMM (or for
        # bfloat16 rows the AMX kernel, where the CPU has it: test_dense_amx.py; or the
        # float32 GEMM on the rows widened, with the AVX2 tiles)
        assert small_linear(x, w) is None
        many = amx_linear(x, w)
        widened = widened_linear(x, w)
        assert (widened is not None) == (dtype == torch.bfloat16 and dense_kernels().tiles)
        if many is None and widened is not None:
            many = widened
            assert torch.equal(widened, gemm_linear(x.float(), w.float()).bfloat16())
        assert torch.equal(linear(x, w), gemm_linear(x, w) if many is None else many)
        assert small_linear(few.float() if dtype != torch.float32 else few.bfloat16(), w) is None
        assert small_linear(few, w.t().contiguous().t()) is None


def _onednn(x, w, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def test_gemm_linear_is_onednn_for_float32():
    """Float32 products past the small-row kernel: oneDNN's inner product (``F.linear``
    where torch is built without oneDNN), whatever the rows' layout, with or without a
    bias; equal to ``F.linear`` within float32 rounding."""
    exact = _onednn if torch.backends.mkldnn.is_available() else F.linear
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    wide = torch.randn(300, 128, generator=g)
    for x in (wide[:, :96], wide[:, :96].contiguous(), wide[:150, :96].reshape(3, 50, 96)):
        for b in (None, bias):
            out = gemm_linear(x, w, b)
            assert out.shape == (*x.shape[:-1], 200)
            assert torch.equal(out, exact(x, w, b))
            torch.testing.assert_close(out, F.linear(x, w, b), **_tolerance(torch.float32, 96))
            assert torch.equal(linear(x, w, b), out)
    assert gemm_linear(torch.ones(0, 96), w).shape == (0, 200)


def test_gemm_linear_leaves_the_rest_to_torch():
    """Other dtypes, a weight that wants gradients and a single vector go to ``F.linear``."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(100, 64, generator=g), torch.randn(32, 64, generator=g)
    for dtype in (torch.bfloat16, torch.float64):
        xd, wd = x.to(dtype), w.to(dtype)
        assert torch.equal(gemm_linear(xd, wd), F.linear(xd, wd))
    trained = w.clone().requires_grad_()
    out = gemm_linear(x, trained)
    out.sum().backward()
    torch.testing.assert_close(trained.grad, x.sum(0).expand(32, 64))
    assert torch.equal(gemm_linear(x[0], w), F.linear(x[0], w))


def test_refuses_what_it_cannot_take():
    kernels = dense_kernels()
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kernels.matmul(torch.ones(1, 4, dtype=torch.float16), torch.ones(2, 4))
    with pytest.raises(ValueError, match="input features"):
        kernels.matmul(torch.ones(1, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.matmul(torch.ones(1, 4), torch.ones(4, 2).t())
