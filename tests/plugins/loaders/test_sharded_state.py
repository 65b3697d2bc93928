"""``--load-format sharded_state``: a tiny Llama's parameters saved by
``LLM.save_sharded_state`` (and by the module's command line), in one file or several,
load by their own names into a model that runs as transformers runs the original, token
for token; a missing, unknown or misshapen parameter is an error naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError

PROMPTS = [[1, 5, 9, 23, 42, 77, 3, 18], [1, 7, 7, 7, 3, 100, 12]]
NEW_TOKENS = 8
FIRST = "model-rank-0-part-0.safetensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sharded") / "llama", "llama", seed=7)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def saved(model_dir, tmp_path_factory):
    """(one file, several files of at most 40 kB), saved from one running LLM."""
    llm = LLM(str(model_dir), dtype="float32", disable_log_stats=True)
    one = tmp_path_factory.mktemp("one")
    llm.save_sharded_state(str(one))
    several = tmp_path_factory.mktemp("several")
    llm.save_sharded_state(str(several), max_size=40_000)
    llm.shutdown()
    return one, several


def sharded_llm(path, **kwargs):
    return LLM(
        str(path), load_format="sharded_state", dtype="float32", disable_log_stats=True, **kwargs
    )


def test_saved_state_matches_transformers(saved, reference, model_dir):
    one, several = saved
    assert sorted(f.name for f in one.glob("*.safetensors")) == [FIRST]
    copied = {f.name for f in one.iterdir()} - {FIRST}
    assert copied == {f.name for f in model_dir.iterdir() if f.suffix != ".safetensors"}
    # The model's own names: the tied head is the embedding, not a tensor of its own.
    state = load_file(one / FIRST)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    assert_matches_reference(sharded_llm(one), reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)

    parts = sorted(several.glob("model-rank-0-part-*.safetensors"))
    assert len(parts) > 2
    assert all(f.stat().st_size < 40_000 + 4096 for f in parts if len(load_file(f)) > 1)
    assert_matches_reference(sharded_llm(several), reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)


def test_command_line_and_pattern(model_dir, reference, tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "pagedllm.plugins.loaders.sharded_state",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--output",
        str(out),
        "--file-pattern",
        "shard-{rank}-{part}.safetensors",
        "--max-file-size",
        "100000",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(list(out.glob("shard-0-*.safetensors"))) > 1
    with pytest.raises(ConfigError, match=r"no model-rank-0-part-\*\.safetensors"):
        sharded_llm(out)
    llm = sharded_llm(out, model_loader_extra_config={"pattern": "shard-{rank}-{part}.safetensors"})
    assert_matches_reference(llm, reference, PROMPTS[:1], NEW_TOKENS, tolerance=1e-3)
    # A second save into the same directory would mix old and new parts.
    again = command[:-2]
    done = subprocess.run(again, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already holds shard files" in done.stderr


def _copy_with_state(source, target, change):
    target.mkdir()
    for file in source.iterdir():
        if file.name != FIRST:
            (target / file.name).write_bytes(file.read_bytes())
    state = load_file(source / FIRST)
    change(state)
    save_file(state, target / FIRST)


def test_missing_unknown_and_misshapen_parameters(saved, tmp_path):
    one, _ = saved
    missing = "model.layers.1.mlp.down_proj.weight"
    _copy_with_state(one, tmp_path / "missing", lambda s: s.pop(missing))
    with pytest.raises(ConfigError, match=rf"no weights for 1 parameter\(s\): {missing}"):
        sharded_llm(tmp_path / "missing")
    _copy_with_state(one, tmp_path / "unknown", lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(ConfigError, match="has a weight 'extra' this model does not know"):
        sharded_llm(tmp_path / "unknown")

    def misshape(state):
        state[missing] = state[missing][:, :-1].contiguous()

    _copy_with_state(one, tmp_path / "shape", misshape)
    with pytest.raises(ConfigError, match=rf"weight '{missing}' has shape \(64, 127\)"):
        sharded_llm(tmp_path / "shape")


def test_refusals(model_dir, tmp_path):
    llm = LLM(str(model_dir), dtype="float32", disable_log_stats=True)
    with pytest.raises(ConfigError, match="is the model directory"):
        llm.save_sharded_state(str(model_dir))
    with pytest.raises(ConfigError, match=r"only \{rank\} and \{part\}"):
        llm.save_sharded_state(str(tmp_path / "a"), pattern="model-{shard}.safetensors")
    with pytest.raises(ConfigError, match=r"needs \{part\} for several files"):
        llm.save_sharded_state(str(tmp_path / "b"), pattern="rank-{rank}.safetensors", max_size=1)
    with pytest.raises(ConfigError, match="max_size must be a positive number of bytes: 0"):
        llm.save_sharded_state(str(tmp_path / "c"), max_size=0)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_size'\]"):
        sharded_llm(model_dir, model_loader_extra_config={"max_size": 10})


def test_quantized_at_load_and_kv_cache_scales(model_dir, tmp_path):
    """With --quantization fp8 the saved state is the float weights the method quantizes
    after loading, so the sharded state quantizes the same way; the checkpoint's KV-cache
    scales are kept."""
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for file in model_dir.iterdir():
        (scaled / file.name).write_bytes(file.read_bytes())
    state = load_file(model_dir / "model.safetensors")
    scales = {"model.layers.0.self_attn.k_scale": 0.25, "model.layers.1.self_attn.v_scale": 0.5}
    state.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(state, scaled / "model.safetensors")
    options = dict(dtype="float32", quantization="fp8", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm):
        model = llm.llm_engine.loaded.model
        attention = [layer.self_attn.attn for layer in model.model.layers]
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(a.k_scale, a.v_scale) for a in attention], [
            (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs
        ]

    original = LLM(str(scaled), disable_log_stats=True, **options)
    expected = run(original)
    assert expected[0] == [(0.25, 1.0), (1.0, 0.5)]
    out = tmp_path / "out"
    original.save_sharded_state(str(out))
    saved = load_file(out / FIRST)
    assert saved["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert saved["model.layers.0.self_attn.attn.checkpoint_k_scale"].item() == 0.25
    assert run(sharded_llm(out, quantization="fp8", kv_cache_dtype="fp8")) == expected
