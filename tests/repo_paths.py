"""Where the repository and its tests are, for test files at any depth under ``tests/``."""

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def load_script(path: Path) -> ModuleType:
    """A script that is not a package module (``benchmarks/*.py``), imported by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
