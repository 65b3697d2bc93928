"""What a test does when the compiled CPU kernels are missing."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from pagedllm.kernels.native import CSRC, c_compiler, cpu_flags, kernels_disabled


def skip_unless_build_failed() -> None:
    """Skip where the kernels cannot exist (no C compiler, or disabled); where a compiler
    is present they must have built, so their absence fails the test."""
    if kernels_disabled() or c_compiler() is None:
        pytest.skip("no C compiler (or kernels disabled): the torch path is used")
    pytest.fail("a C compiler is present but the CPU kernels did not build (see the log)")


# The non-AVX-512 builds of a kernel file, as a machine of the other kind compiles them.
OTHER_VECTOR_PATHS = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2"]}


def build_variant(tmp_path: Path, source: str, flags: list[str]) -> ctypes.CDLL:
    """``csrc/<source>`` compiled here with ``flags`` added (AVX-512, AVX2 switched off)
    and loaded; the test skips where that cannot be built (no compiler, no AVX2 CPU)."""
    compiler = c_compiler()
    if compiler is None or "avx2" not in cpu_flags().split():
        pytest.skip("needs a C compiler and an AVX2 CPU")
    library = tmp_path / f"{Path(source).stem}_variant.so"
    command = [compiler, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([*command, "-o", str(library), str(CSRC / source)], check=True)
    return ctypes.CDLL(str(library))
