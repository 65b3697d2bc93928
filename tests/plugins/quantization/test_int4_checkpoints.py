"""GPTQ and AWQ 4-bit checkpoints (``--quantization gptq`` / ``awq``, detected from
``quantization_config``), written here in AutoGPTQ's and AutoAWQ's published layouts
(neither tool runs on this CPU) and checked by dequantizing with their recipe. The weights
are repacked exactly, so greedy tokens equal transformers' with the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from int4_writer import _write
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.ggml_types import GGMLQuantizationType

PROMPTS = [[1, 5, 9, 23, 42, 77, 3], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("int4") / "llama", "llama", seed=7)


@pytest.mark.parametrize(
    ("method", "group", "sym", "act_order", "qtype"),
    [
        ("gptq", 32, True, False, GGMLQuantizationType.Q4_0),
        ("gptq", 64, False, True, GGMLQuantizationType.Q8_0),
        ("gptq", -1, True, True, GGMLQuantizationType.Q4_0),
        ("awq", 32, False, False, GGMLQuantizationType.Q8_0),
        ("awq", 64, False, False, GGMLQuantizationType.Q8_0),
    ],
    ids=["gptq-32-sym", "gptq-64-actorder", "gptq-channel-actorder", "awq-32", "awq-64"],
)
def test_greedy_matches_the_dequantized_reference(
    float_checkpoint, tmp_path, method, group, sym, act_order, qtype
):
    target = tmp_path / method
    dequantized = _write(float_checkpoint, target, method, group, sym, act_order)
    llm = LLM(str(target), dtype="float32", disable_log_stats=True)
    model = llm.llm_engine.loaded.model
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.uint8 and down.method.qtype == qtype
    # (Columns are reordered only where act-order made groups that are not contiguous.)
    assert (down.int4_perm is not None) == (act_order and group != -1)
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # (ignored)

    reference = load_reference(float_checkpoint)
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)
    # Q/K/V (and gate/up) of one type become one packed product, and the decoder layer
    # runs natively (one call a layer), unless act-order reordered their columns.
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    ordered = [m.int4_perm is None for m in (*qkv, attn.o_proj, mlp.gate_proj, mlp.down_proj)]
    assert (attn.qkv.runs[0].qtype is not None) == all(ordered[:3])
    assert bool(layer._native) == all(ordered)
    assert all(ordered) == (not act_order or group == -1)


def test_marlin_names_and_refusals(float_checkpoint, tmp_path):
    target = tmp_path / "gptq"
    _write(float_checkpoint, target, "gptq", 32)
    # vLLM's names for its fast GPTQ / AWQ kernels read the same checkpoints.
    llm = LLM(str(target), quantization="gptq_marlin", dtype="float32", disable_log_stats=True)
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs
    with pytest.raises(ConfigError, match="quantized with 'gptq'"):
        LLM(str(target), quantization="awq", dtype="float32", disable_log_stats=True)
    config = json.loads((target / "config.json").read_text())
    for change, message in (
        ({"bits": 8}, "8-bit weights"),
        ({"checkpoint_format": "gptq_v2"}, "checkpoint_format"),
        ({"mystery": 1}, "unknown gptq settings"),
    ):
        quant = {**config["quantization_config"], **change}
        (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ConfigError, match=message):
            LLM(str(target), dtype="float32", disable_log_stats=True)
    with pytest.raises(ConfigError, match="does not quantize float weights"):
        LLM(str(float_checkpoint), quantization="gptq", dtype="float32", disable_log_stats=True)
