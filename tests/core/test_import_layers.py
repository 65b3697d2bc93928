"""The import-linter contracts of ``pyproject.toml`` (layers, independent plugin packages,
no import cycles) hold for the package, and they do catch what they forbid: a deferred
upward import, one plugin package importing another, a new cycle. ``.ci/run`` runs
``lint-imports`` too; this keeps ``pytest`` failing when a contract breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT

LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the ``pagedllm`` package under ``root``, with its pyproject."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", LINT, "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "pagedllm",
        tmp_path / "pagedllm",
        ignore=shutil.ignore_patterns("__pycache__", "csrc", "*.so"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_the_contracts_catch_upward_imports_plugin_imports_and_cycles(tmp_path):
    root = copy_of_the_package(tmp_path)
    # A deferred import in a kernel of the serving layer: upward, and a cycle (the
    # entrypoints import the kernels).
    append(
        root / "pagedllm" / "kernels" / "norms.py",
        "\n\ndef _upward():\n    from pagedllm.entrypoints import llm\n\n    return llm\n",
    )
    # One plugin package importing another.
    append(
        root / "pagedllm" / "plugins" / "guided" / "__init__.py",
        "\nfrom pagedllm.plugins.models import common as _common  # noqa: E402\n",
    )
    result = lint_imports(root)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "pagedllm.kernels is not allowed to import pagedllm.entrypoints" in out
    assert "pagedllm.kernels.norms -> pagedllm.entrypoints.llm" in out
    assert "pagedllm.plugins.guided is not allowed to import pagedllm.plugins.models" in out
    assert "No cycles are allowed in pagedllm." in out
    assert "0 kept, 3 broken" in out


def test_type_checking_imports_are_exempt(tmp_path):
    root = copy_of_the_package(tmp_path)
    append(
        root / "pagedllm" / "kernels" / "norms.py",
        "\n\nfrom typing import TYPE_CHECKING  # noqa: E402\n\nif TYPE_CHECKING:\n"
        "    from pagedllm.entrypoints.llm import LLM  # noqa: F401\n",
    )
    result = lint_imports(root)
    assert result.returncode == 0, result.stdout + result.stderr
