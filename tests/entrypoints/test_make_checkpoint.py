"""``benchmarks/make_checkpoint.py``: a checkpoint directory of random weights in the
shape asked for, with a copied tokenizer, that pagedllm loads and runs natively."""

from __future__ import annotations

import json
import subprocess
import sys

from repo_paths import ROOT
from safetensors import safe_open
from tokenizer_fixtures import make_tokenizer

from pagedllm import LLM, SamplingParams

SCRIPT = ROOT / "benchmarks" / "make_checkpoint.py"


def _make(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, arguments)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_qwen3_shape_loads_and_generates(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tok")
    out = tmp_path / "qwen3"
    shape = ("--hidden", 64, "--layers", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 32)
    made = _make(
        out,
        "--arch",
        "qwen3",
        *shape,
        "--ffn",
        96,
        "--vocab",
        len(tokenizer) + 7,
        "--dtype",
        "float32",
        "--tokenizer-from",
        tmp_path / "tok",
    )
    assert made.returncode == 0, made.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"]
    assert (config["head_dim"], config["num_key_value_heads"]) == (32, 2)
    assert config["vocab_size"] == len(tokenizer) + 7
    assert config["eos_token_id"] == tokenizer.eos_token_id
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        q = weights.get_tensor("model.layers.1.self_attn.q_proj.weight")
        assert tuple(q.shape) == (4 * 32, 64) and str(q.dtype) == "torch.float32"
    assert (out / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()

    llm = LLM(str(out), dtype="float32", max_model_len=64, disable_log_stats=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(["one two three"], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
    # (the decoder layers took the decode steps as native calls, Qwen3's head norms included)
    assert all(layer._native for layer in llm.llm_engine.runner.model.model.layers)


def test_bad_shapes_and_sources_are_refused(tmp_path):
    make_tokenizer(tmp_path / "tok")
    base = ("--arch", "llama", "--hidden", 64, "--layers", 1, "--ffn", 96)
    uneven = _make(
        tmp_path / "a", *base, "--heads", 4, "--kv-heads", 3, "--tokenizer-from", tmp_path / "tok"
    )
    assert uneven.returncode == 2 and "multiple of --kv-heads 3" in uneven.stderr
    missing = _make(tmp_path / "b", *base, "--heads", 4, "--tokenizer-from", tmp_path)
    assert missing.returncode == 2 and "no tokenizer.json" in missing.stderr
    small = _make(
        tmp_path / "c", *base, "--heads", 4, "--vocab", 10, "--tokenizer-from", tmp_path / "tok"
    )
    assert small.returncode == 2 and "--vocab 10 is below" in small.stderr
    assert not (tmp_path / "c").exists()
