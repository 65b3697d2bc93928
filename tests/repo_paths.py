"""Where the repository and its tests are, for test files at any depth under ``tests/``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
