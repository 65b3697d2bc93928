"""The Triton kernels that decode fp8 and bitsandbytes weights on GPUs, run on CPU by
Triton's interpreter: bit for bit against their torch references."""

from __future__ import annotations

import os

# Before triton is imported anywhere: run kernels with the numpy interpreter (no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.kernels import bnb, fp8
from pagedllm.kernels.triton_quant import (
    triton_dequantize_4bit,
    triton_dequantize_fp8,
    triton_dequantize_int8,
)

# (rows, columns): tiles that fit, and edges that do not (masked).
SHAPES = [(16, 64), (37, 200), (5, 1000)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8(n, k, dtype):
    torch.manual_seed(n)
    weight = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    for group in (k, 64, 7):  # per row, block-wise, odd groups
        scale = torch.rand(n, -(-k // group)) / 400 + 1e-3
        expected = fp8.dequantize_fp8_reference(weight, scale, group, dtype)
        assert torch.equal(triton_dequantize_fp8(weight, scale, group, dtype), expected)


def test_fp8_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # (the two NaNs)
    weight = codes.view(torch.float8_e4m3fn).reshape(2, -1).contiguous()
    ones = torch.ones(2, 1)
    got = triton_dequantize_fp8(weight, ones, weight.shape[1], torch.float32)
    assert torch.equal(got, weight.float())


@pytest.mark.parametrize(("n", "k"), [(16, 64), (37, 256), (5, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4bit(n, k, dtype):
    torch.manual_seed(k)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    code = torch.randn(16)
    for groups in (1, k // 64):
        absmax = torch.rand(n, groups) + 0.05
        expected = bnb.dequantize_4bit_reference(packed, absmax, code, dtype)
        assert torch.equal(triton_dequantize_4bit(packed, absmax, code, dtype), expected)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8(n, k):
    torch.manual_seed(k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = bnb.int8_row_scale(torch.rand(n) * 5)
    for dtype in (torch.float32, torch.bfloat16):
        expected = bnb.dequantize_int8_reference(q, scale, dtype)
        assert torch.equal(triton_dequantize_int8(q, scale, dtype), expected)
