"""``--model-impl transformers`` on every causal LM transformers ships whose attention goes
through its attention interface: a tiny random model of each (``tiny_causal_lms``) keeps
transformers' greedy tokens, or is refused at load with a ``ConfigError`` naming it. A
crash, a mismatch or an unnamed refusal fails; so does a README whose count is not this
run's (for the transformers version it names)."""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from repo_paths import ROOT
from tiny_causal_lms import causal_lm_types, make_tiny_causal_lm
from tiny_models import reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError

NEW_TOKENS = 8
PROMPTS = [[17, 200, 33, 91, 405], [300, 301, 12, 8, 77, 64, 99, 150, 260, 7, 8]]
README = ROOT / "README.md"

# model type -> why no tiny model of it is made here
UNBUILDABLE = {
    "gemma3n": "its vision tower needs timm and pillow",
    "dots3_note": "per-layer-type sub-configs the shrinker does not reach",
    "dots3_note_text": "per-layer-type sub-configs the shrinker does not reach",
}


def _divergence(got: list[int], tokens: list[int], top: list[dict[int, float]]) -> str:
    step = next(i for i, (a, b) in enumerate(zip(got, tokens, strict=True)) if a != b)
    first, second = sorted(top[step].values(), reverse=True)[:2]
    return f"step {step}: {got[step]} for {tokens[step]} (their top-2 gap {first - second:.2g})"


def _run(model_type: str, directory: Path) -> tuple[str, str]:
    """``(outcome, detail)``: ``pass``, ``refused`` (the message), ``unbuildable`` (the
    error making it), ``mismatch`` or ``crash`` (what happened)."""
    try:
        model = make_tiny_causal_lm(directory, model_type)
    except Exception as exc:
        return "unbuildable", f"{type(exc).__name__}: {exc}"
    try:
        return _compare(model, directory)
    finally:
        shutil.rmtree(directory)


def _compare(model: Any, directory: Path) -> tuple[str, str]:
    try:
        llm = LLM(
            str(directory), dtype="float32", model_impl="transformers", max_model_len=64,
            num_gpu_blocks_override=16, block_size=8, disable_log_stats=True,
        )  # fmt: skip
    except ConfigError as exc:
        return "refused", str(exc)
    except Exception as exc:
        return "crash", f"at load: {type(exc).__name__}: {exc}"
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:
        return "crash", f"generating: {type(exc).__name__}: {exc}"
    finally:
        llm.shutdown()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        try:
            tokens, top = reference_greedy(model, prompt, NEW_TOKENS, num_logprobs=2)
        except Exception as exc:
            return "crash", f"transformers' own generate: {type(exc).__name__}: {exc}"
        got = list(output.outputs[0].token_ids)
        if got != tokens:
            return "mismatch", _divergence(got, tokens, top)
    return "pass", ""


@pytest.fixture
def one_thread():
    """One torch thread: tiny models run many times faster so on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_causal_lm(tmp_path, one_thread):
    transformers.logging.set_verbosity_error()
    results = {t: _run(t, tmp_path / t) for t in causal_lm_types()}
    by_outcome: dict[str, dict[str, str]] = defaultdict(dict)
    for model_type, (outcome, detail) in results.items():
        by_outcome[outcome][model_type] = detail
    counts = {outcome: len(found) for outcome, found in sorted(by_outcome.items())}
    print(f"\ntransformers {transformers.__version__}: {counts}")
    for model_type, detail in sorted(by_outcome["refused"].items()):
        print(f"  refused {model_type}: {detail}")
    failures = {**by_outcome["crash"], **by_outcome["mismatch"]}
    assert not failures, failures
    classes = causal_lm_types()
    unnamed = {
        t: message
        for t, message in by_outcome["refused"].items()
        if classes[t].__name__ not in message and t not in message
    }
    assert not unnamed, f"refused without naming the model: {unnamed}"
    assert by_outcome["unbuildable"].keys() <= UNBUILDABLE.keys(), by_outcome["unbuildable"]
    # The README says how many pass, with this transformers (and these not tried).
    claim = re.search(
        r"transformers ([\d.]+).{0,80}?(\d+) of the (\d+) causal-LM", README.read_text(), re.S
    )
    assert claim, "README.md states no count for --model-impl transformers"
    if (claim.group(1), by_outcome["unbuildable"].keys()) == (
        transformers.__version__,
        UNBUILDABLE.keys(),
    ):
        tried = len(results) - len(UNBUILDABLE)
        assert (int(claim.group(2)), int(claim.group(3))) == (counts["pass"], tried)
