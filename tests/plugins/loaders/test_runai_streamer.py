"""``--load-format runai_streamer``: a tiny Llama's safetensors read by Run:ai Model
Streamer (the real ``runai-model-streamer`` package) runs as transformers runs it, token
for token; its ``concurrency`` and ``memory_limit`` settings reach the streamer."""

from __future__ import annotations

import json
import os
import sys

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM
from pagedllm.core.errors import ConfigError

PROMPTS = [[1, 5, 9, 23, 42, 77, 3, 18], [1, 7, 7, 7, 3, 100, 12]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose weights are split over two safetensors files and an index."""
    directory = make_checkpoint(tmp_path_factory.mktemp("runai") / "llama", "llama", seed=5)
    state = load_file(directory / "model.safetensors")
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in halves.items():
        save_file({name: state[name] for name in part}, directory / file)
    (directory / "model.safetensors").unlink()
    weight_map = {name: file for file, part in halves.items() for name in part}
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_streamed_weights_match_transformers(checkpoint):
    before = {
        k: os.environ.get(k) for k in ("RUNAI_STREAMER_CONCURRENCY", "RUNAI_STREAMER_MEMORY_LIMIT")
    }
    llm = LLM(
        str(checkpoint),
        load_format="runai_streamer",
        model_loader_extra_config={"concurrency": 4, "memory_limit": 1 << 20},
        dtype="float32",
        disable_log_stats=True,
    )
    assert_matches_reference(llm, load_reference(checkpoint), PROMPTS, NEW_TOKENS, tolerance=1e-3)
    # The settings are the streamer's environment only while it streams.
    assert {k: os.environ.get(k) for k in before} == before


def test_memory_limit_reaches_the_streamer(checkpoint):
    # Smaller than the largest tensor (the embedding): the streamer itself refuses it.
    with pytest.raises(ConfigError, match=r"memory_limit=1000\).*cannot be smaller"):
        LLM(
            str(checkpoint),
            load_format="runai_streamer",
            model_loader_extra_config={"memory_limit": 1000},
            dtype="float32",
            disable_log_stats=True,
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"concurrency": 4, "chunk_size": 1}, r"unknown key\(s\) \['chunk_size'\].*'concurrency'"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1"),
        ({"memory_limit": "1GB"}, "memory_limit must be an integer >= -1"),
    ],
)
def test_bad_extra_config_refused(checkpoint, extra, message):
    with pytest.raises(ConfigError, match=message):
        LLM(
            str(checkpoint),
            load_format="runai_streamer",
            model_loader_extra_config=extra,
            disable_log_stats=True,
        )


def test_missing_package_named(checkpoint, monkeypatch):
    # (None in sys.modules makes ``import runai_model_streamer`` fail, as if uninstalled.)
    monkeypatch.setitem(sys.modules, "runai_model_streamer", None)
    with pytest.raises(ConfigError, match="pip install runai-model-streamer"):
        LLM(str(checkpoint), load_format="runai_streamer", disable_log_stats=True)
