"""Triton GGUF dequantization kernels, run on CPU by Triton's interpreter: bit-exact against
``gguf.quants`` and pagedllm's torch reference."""

from __future__ import annotations

import os

# Before triton is imported anywhere: run kernels with the numpy interpreter (no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

pytest.importorskip("triton")

from test_gguf_dequant import (
    FP16_FIELDS,
    QUANTIZABLE,
    _quantized_blocks,
    _random_blocks,
    _shapes,
)

from pagedllm.kernels.gguf_dequant import SUPPORTED_TYPES, dequantize
from pagedllm.kernels.gguf_matmul import gguf_linear_reference, triton_gguf_linear
from pagedllm.kernels.triton_gguf import triton_available, triton_dequantize

T = GGMLQuantizationType
PLAIN = (T.F32, T.F16, T.BF16)


def _gguf_reference(raw: np.ndarray, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    out = torch.from_numpy(np.asarray(gq.dequantize(raw, qtype), dtype=np.float32))
    return out.reshape(shape)


def _assert_exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]):
    got = triton_dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    expected = _gguf_reference(raw, qtype, shape)
    assert torch.equal(got, expected), (
        f"{qtype.name} {shape}: max abs diff {(got - expected).abs().max()}"
    )
    assert torch.equal(got, dequantize(torch.from_numpy(raw), qtype, shape))


def test_available_and_covers_every_supported_type():
    assert triton_available()
    assert {*FP16_FIELDS, *QUANTIZABLE} == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", tuple(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype: GGMLQuantizationType):
    # Random bytes reach every bit pattern of quants, scales and mins.
    for i, shape in enumerate(_shapes(qtype)):
        _assert_exact(_random_blocks(qtype, shape, seed=200 + i), qtype, shape)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_bit_exact(qtype: GGMLQuantizationType):
    for i, shape in enumerate(_shapes(qtype)):
        _assert_exact(_quantized_blocks(qtype, shape, seed=i), qtype, shape)


@pytest.mark.parametrize("qtype", PLAIN, ids=lambda t: t.name)
def test_plain_floats_keep_inf_nan_and_bits(qtype: GGMLQuantizationType):
    """Arbitrary bytes, several programs' worth with a ragged end, plus inf/NaN patterns:
    the same bits as gguf.quants (NaN payloads included)."""
    width = 4 if qtype == T.F32 else 2
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(3, 700 * width), dtype=np.uint8)
    special = {
        T.F32: np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32),
        T.F16: np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float16),
        T.BF16: np.array([0x7F80, 0xFF80, 0x7FC1, 0x8000], dtype=np.uint16),
    }[qtype]
    raw[0, : 4 * width] = special.view(np.uint8)
    got = triton_dequantize(torch.from_numpy(raw), qtype, (3, 700))
    expected = _gguf_reference(raw, qtype, (3, 700))
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    # torch's fp16 widening makes every NaN one canonical NaN, so compare values here.
    ref = dequantize(torch.from_numpy(raw), qtype, (3, 700))
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_int_qtype_flat_raw_odd_offset_and_dtype():
    shape = (4, 256)
    raw = _random_blocks(T.Q4_K, shape, seed=7)
    ref = dequantize(torch.from_numpy(raw), T.Q4_K, shape)
    flat = torch.from_numpy(raw.reshape(-1).copy())
    assert torch.equal(triton_dequantize(flat, int(T.Q4_K), shape), ref)
    padded = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    assert torch.equal(triton_dequantize(padded, T.Q4_K, shape), ref)
    got = triton_dequantize(flat, T.Q4_K, shape, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref.bfloat16())
    empty = triton_dequantize(torch.zeros(0, 144, dtype=torch.uint8), T.Q4_K, (0, 256))
    assert empty.shape == (0, 256)


def test_unsupported_type_and_bad_input():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        triton_dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="IQ2_XXS"):
        raw = torch.zeros(1, 66, dtype=torch.uint8)
        triton_gguf_linear(torch.zeros(1, 256), raw, T.IQ2_XXS, 1, 256)
    with pytest.raises(ValueError, match="unknown GGML tensor type"):
        triton_dequantize(torch.zeros(4, dtype=torch.uint8), 12345, (1,))
    with pytest.raises(ValueError, match="does not hold shape"):
        triton_dequantize(torch.zeros(17, dtype=torch.uint8), T.Q4_0, (32,))
    with pytest.raises(TypeError, match="uint8"):
        triton_dequantize(torch.zeros(18, dtype=torch.int8), T.Q4_0, (32,))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_triton_gguf_linear_matches_reference(qtype: GGMLQuantizationType):
    out_features, in_features = 20, 512
    if qtype in FP16_FIELDS:
        raw = _random_blocks(qtype, (out_features, in_features), seed=3)
    else:
        raw = _quantized_blocks(qtype, (out_features, in_features), seed=3)
    raw_t = torch.from_numpy(raw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    for b in (None, bias):
        expected = gguf_linear_reference(x, raw_t, qtype, out_features, in_features, b)
        # chunk of 8 rows: full chunks and a ragged last one.
        for chunk in (8, 1024):
            got = triton_gguf_linear(x, raw_t, qtype, out_features, in_features, b, chunk)
            assert got.shape == (2, 3, out_features)
            # A 512-term float32 dot product summed in another order (the interpreter's
            # numpy dot, the reference's BLAS) differs by a few 1e-5.
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="features"):
        triton_gguf_linear(x[..., :32], raw_t, qtype, out_features, in_features)
