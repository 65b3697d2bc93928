"""What a test does when the compiled CPU kernels are missing."""

from __future__ import annotations

import pytest

from pagedllm.kernels.native import c_compiler, kernels_disabled


def skip_unless_build_failed() -> None:
    """Skip where the kernels cannot exist (no C compiler, or disabled); where a compiler
    is present they must have built, so their absence fails the test."""
    if kernels_disabled() or c_compiler() is None:
        pytest.skip("no C compiler (or kernels disabled): the torch path is used")
    pytest.fail("a C compiler is present but the CPU kernels did not build (see the log)")
