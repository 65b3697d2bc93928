"""Shared test helpers.

The dummy plugin under ``tests/plugins/dummy_plugin`` is a real pip package; the test
command installs it, and this file installs it when it is missing (no network needed).
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

# Triton reads TRITON_INTERPRET when it is imported (its standard library's functions are
# compiled or interpreted from then on), and a test module may import it indirectly
# before the Triton tests run: the Triton kernels' tests (on CPU tensors) run in the
# interpreter unless the environment says otherwise.
os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).parent
DUMMY_PLUGIN = TESTS / "plugins" / "dummy_plugin"
DUMMY_PLUGIN_VERSION = "0.6.0"


def pytest_configure(config: pytest.Config) -> None:
    try:
        installed = importlib.metadata.version("pagedllm-dummy-plugin")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != DUMMY_PLUGIN_VERSION:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--force-reinstall",
                str(DUMMY_PLUGIN),
            ],
            check=True,
        )
        importlib.invalidate_caches()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``pagedllm ARGS`` in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        cwd=cwd,
        timeout=timeout,
    )


def make_distribution(
    site: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Write an installed distribution (``*.dist-info`` plus modules) into ``site``, so a
    process with ``site`` on ``PYTHONPATH`` discovers its ``pagedllm`` entry points."""
    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    lines = ["[pagedllm]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


def write_plugin_project(
    root: Path, dist: str, entry_point: str, package: str, files: dict[str, str]
) -> Path:
    """Write a pip-installable plugin project (``pyproject.toml`` declaring the ``pagedllm``
    entry point ``entry_point = package``, and the package's ``files``) under ``root``."""
    project = root / dist
    (project / package).mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "1.0.0"

            [project.entry-points.pagedllm]
            {entry_point} = "{package}"

            [tool.setuptools]
            packages = ["{package}"]
            """
        )
    )
    for name, source in files.items():
        (project / package / name).write_text(textwrap.dedent(source))
    return project


def pip_install_target(site: Path, *projects: Path) -> Path:
    """``pip install --target site`` the projects, as a user installs a plugin (without
    touching this environment); a process with ``site`` on ``PYTHONPATH`` finds them."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(site),
            *map(str, projects),
        ],
        check=True,
        timeout=300,
    )
    return site


def env_with_site(site: Path, **extra: str) -> dict[str, str]:
    """:func:`clean_env` with ``site`` put first on ``PYTHONPATH`` (the rest kept)."""
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return clean_env(PYTHONPATH=os.pathsep.join(paths), **extra)


@pytest.fixture(autouse=True, scope="module")
def _free_engines_left_running():
    """After each test module, the engines its tests left running (an engine freezes
    the garbage collector's objects until it shuts down) are collected: their KV caches,
    committed memory, would otherwise add up over the session until the kernel refuses
    a fork (a Ray instance's processes, say) for want of memory."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture
def pm():
    from pagedllm.core.plugins import make_plugin_manager

    return make_plugin_manager(env={})


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-1.5 checkpoint with its processor files (tests/tiny_llava.py)."""
    from tiny_llava import make_llava

    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llava_reference(llava_checkpoint: Path) -> Any:
    """transformers' model of :func:`llava_checkpoint`, for reference outputs."""
    from tiny_llava import LlavaReference

    return LlavaReference(llava_checkpoint)
