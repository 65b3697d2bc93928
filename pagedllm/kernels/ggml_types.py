"""GGML tensor types and their block layouts, as the GGUF format fixes them.

The ``gguf`` package has the same constants, but importing it builds its whole writer,
reader and metadata machinery (about 30 ms), which the start of a server should not pay
for an enum. ``tests/kernels/test_gguf_dequant.py`` checks these against the package.
"""

from __future__ import annotations

from enum import IntEnum

QK_K = 256  # values per super-block of the k-quants


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLQuantizationType

# Type -> (values per block, bytes per block).
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _T.F32: (1, 4),
    _T.F16: (1, 2),
    _T.Q4_0: (32, 2 + 16),
    _T.Q4_1: (32, 2 + 2 + 16),
    _T.Q5_0: (32, 2 + 4 + 16),
    _T.Q5_1: (32, 2 + 2 + 4 + 16),
    _T.Q8_0: (32, 2 + 32),
    _T.Q8_1: (32, 4 + 4 + 32),
    _T.Q2_K: (256, 2 + 2 + QK_K // 16 + QK_K // 4),
    _T.Q3_K: (256, 2 + QK_K // 4 + QK_K // 8 + 12),
    _T.Q4_K: (256, 2 + 2 + QK_K // 2 + 12),
    _T.Q5_K: (256, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    _T.Q6_K: (256, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    _T.Q8_K: (256, 4 + QK_K + QK_K // 8),
    _T.IQ2_XXS: (256, 2 + QK_K // 4),
    _T.IQ2_XS: (256, 2 + QK_K // 4 + QK_K // 32),
    _T.IQ3_XXS: (256, 2 + QK_K // 4 + QK_K // 8),
    _T.IQ1_S: (256, 2 + QK_K // 8 + QK_K // 16),
    _T.IQ4_NL: (32, 2 + 16),
    _T.IQ3_S: (256, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    _T.IQ2_S: (256, 2 + QK_K // 4 + QK_K // 16),
    _T.IQ4_XS: (256, 2 + 2 + QK_K // 2 + QK_K // 64),
    _T.I8: (1, 1),
    _T.I16: (1, 2),
    _T.I32: (1, 4),
    _T.I64: (1, 8),
    _T.F64: (1, 8),
    _T.IQ1_M: (256, QK_K // 8 + QK_K // 16 + QK_K // 32),
    _T.BF16: (1, 2),
    _T.TQ1_0: (256, 2 + 4 * 13),
    _T.TQ2_0: (256, 2 + 64),
    _T.MXFP4: (32, 1 + 16),
    _T.NVFP4: (64, 4 + 32),
    _T.Q1_0: (128, 2 + 16),
}
