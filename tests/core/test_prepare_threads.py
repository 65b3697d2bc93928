"""``PAGEDLLM_MM_PREPROCESS_THREADS``: the async engine's threads that prepare prompts
(multimodal prompts' images preprocessed off the engine thread); a bad value is refused by
name."""

from __future__ import annotations

import pytest

from pagedllm.core.async_engine import (
    DEFAULT_PREPARE_THREADS,
    PREPARE_THREADS_VARIABLE,
    prepare_threads,
)
from pagedllm.core.errors import ConfigError


def test_the_variable_sets_the_prepare_threads(monkeypatch):
    monkeypatch.delenv(PREPARE_THREADS_VARIABLE, raising=False)
    assert prepare_threads() == DEFAULT_PREPARE_THREADS
    monkeypatch.setenv(PREPARE_THREADS_VARIABLE, "2")
    assert prepare_threads() == 2
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv(PREPARE_THREADS_VARIABLE, bad)
        with pytest.raises(ConfigError, match=f"PAGEDLLM_MM_PREPROCESS_THREADS={bad!r}"):
            prepare_threads()
