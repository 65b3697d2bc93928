"""`import pagedllm` sets GNU OpenMP's spin count before torch loads libgomp, unless the
user chose one (or a wait policy), and never pretends to after torch is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = "import os, {first}; import torch; print(os.environ.get('GOMP_SPINCOUNT', '-'))"


def _spincount(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(first=first)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip()


def test_default_spincount_is_set_before_torch_loads() -> None:
    assert _spincount("pagedllm") == "10000"


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"GOMP_SPINCOUNT": "123"}, "123"), ({"OMP_WAIT_POLICY": "passive"}, "-")],
)
def test_the_users_openmp_choice_wins(env: dict[str, str], expected: str) -> None:
    assert _spincount("pagedllm", **env) == expected


def test_nothing_is_set_once_torch_is_already_loaded() -> None:
    # libgomp has read its environment by then: setting the variable would change nothing
    # in this process and only mislead its children.
    assert _spincount("torch, pagedllm") == "-"
