"""``benchmarks/perplexity.py``: the perplexity it reports from the engine's prompt logprobs
is transformers' on the same chunks (float32), and it runs as a script."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import transformers
from repo_paths import ROOT, load_script
from tiny_models import make_checkpoint

from pagedllm import LLM

SCRIPT = ROOT / "benchmarks" / "perplexity.py"


def _script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _reference(checkpoint, windows) -> float:
    """transformers' perplexity of the second half of each window."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(torch.tensor([window])).logits[0].float()
            logprobs = logits.log_softmax(dim=-1)
            for position in range(len(window) // 2, len(window)):
                total -= logprobs[position - 1, window[position]].item()
                count += 1
    return math.exp(total / count)


def test_the_perplexity_is_transformers_on_the_same_chunks(checkpoint):
    script = _script()
    text = script.TEXT.read_text(encoding="utf-8")[:3000]
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True)
    result = script.perplexity(llm, text, context=64)
    token_ids = llm.get_tokenizer().encode(text)
    windows = script.chunks(token_ids, 64)
    assert result["chunks"] == len(windows) == len(token_ids) // 64 > 1
    assert result["scored_tokens"] == 32 * len(windows)
    assert result["perplexity"] == pytest.approx(_reference(checkpoint, windows), rel=1e-4)
    with pytest.raises(ValueError, match="fewer than one chunk"):
        script.chunks(token_ids[:10], 64)


def test_the_script_compares_each_dtype_with_float32(checkpoint, tmp_path):
    out = tmp_path / "ppl.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            str(checkpoint),
            "--dtype",
            "bfloat16",
            "float32",
            "--context",
            "64",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bfloat16 against float32:" in result.stdout
    import json

    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"bfloat16", "float32"}
    assert all(row["perplexity"] > 1 for row in rows.values())
