"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), written by the
compressed-tensors library itself (its quantization config applied to a tiny
transformers model, scales set, then its own ``ModelCompressor`` compressing and saving),
and checked against transformers running the weights the library decompresses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.ggml_types import GGMLQuantizationType

PROMPTS = [[1, 5, 9, 23, 42, 77, 3], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10
IGNORED = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ct") / "llama", "llama", seed=11)


def _write(source, target, weights: QuantizationArgs, fmt: str, activations=None, fp16_scales=True):
    """The library's own checkpoint of ``source``, min/max scales per its strategy (fp16
    values, so that integer weights repack exactly), and the float32 weights it
    decompresses to."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head", IGNORED], format=fmt
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        if weights.strategy == "block":
            rows, cols = weights.block_structure
            tiles = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
            low, high = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
        else:
            if weights.strategy == "group":
                runs = w.reshape(w.shape[0], -1, weights.group_size)
            elif weights.strategy == "channel":
                runs = w.reshape(w.shape[0], 1, -1)
            else:
                runs = w.reshape(1, 1, -1)
            low, high = runs.amin(-1), runs.amax(-1)
        scale, zero = calculate_qparams(low, high, weights)
        if fp16_scales:
            scale = scale.half().float()
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    shutil.copytree(source, target)  # (the tokenizer; the model is saved over it)
    model.save_pretrained(target)
    compressor.update_config(target)
    # What the library itself reads back: decompressed weights.
    compressor.decompress_model(model)
    return {
        name: module.weight.data.float().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in name and name != IGNORED
    }


CASES = {
    "w4a16-group-asym": (
        QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        "pack-quantized",
        GGMLQuantizationType.Q8_0,
    ),
    "w4a16-channel-sym": (
        QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel"),
        "pack-quantized",
        GGMLQuantizationType.Q4_0,
    ),
    "w8a16-channel": (
        QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "pack-quantized",
        GGMLQuantizationType.Q8_0,
    ),
    "w8a8-int8": (
        QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "int-quantized",
        GGMLQuantizationType.Q8_0,
    ),
    "fp8-channel": (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
        "float-quantized",
        None,
    ),
    "fp8-block": (
        QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]
        ),
        "float-quantized",
        None,
    ),
    "fp8-tensor": (
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        "float-quantized",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoints(float_checkpoint, tmp_path, case):
    weights, fmt, qtype = CASES[case]
    activations = None
    if case == "w8a8-int8":  # (dynamic per-token activations: weight-only here)
        activations = QuantizationArgs(
            num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
        )
    dequantized = _write(float_checkpoint, tmp_path / case, weights, fmt, activations)
    llm = LLM(str(tmp_path / case), dtype="float32", disable_log_stats=True)
    model = llm.llm_engine.loaded.model
    down = model.model.layers[0].mlp.down_proj
    if qtype is None:
        assert down.weight.dtype == torch.float8_e4m3fn
    else:
        assert down.weight.dtype == torch.uint8 and down.method.qtype == qtype
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # (ignored)
    reference = load_reference(float_checkpoint)
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_submodule(name).weight.copy_(weight)
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)


def test_scales_blocks_cannot_hold_run_dequantized(float_checkpoint, tmp_path, caplog):
    """float32 scales that are not fp16 values cannot go into GGML blocks: those layers run
    dequantized (still the library's weights), with a warning, also when the log has
    already said that the scheme's activation quantization is not used."""
    weights, fmt, _ = CASES["w8a8-int8"]
    activations = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    target = tmp_path / "f32-scales"
    dequantized = _write(float_checkpoint, target, weights, fmt, activations, fp16_scales=False)
    with caplog.at_level("INFO", logger="pagedllm.quantization"):
        llm = LLM(str(target), dtype="float32", disable_log_stats=True)
    messages = [record.getMessage() for record in caplog.records]
    assert any("activation quantization is not used" in m for m in messages)
    assert any("run dequantized" in m for m in messages)
    down = llm.llm_engine.loaded.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float32 and down.method.qtype is None
    reference = load_reference(float_checkpoint)
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_submodule(name).weight.copy_(weight)
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)


def test_refusals(float_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="does not quantize float weights"):
        LLM(str(float_checkpoint), quantization="compressed-tensors", dtype="float32")
    target = tmp_path / "w4"
    weights, fmt, _ = CASES["w4a16-channel-sym"]
    _write(float_checkpoint, target, weights, fmt)
    config = json.loads((target / "config.json").read_text())
    quant = config["quantization_config"]
    for change, message in (
        ({"quantization_status": "frozen"}, "only compressed checkpoints"),
        ({"sparsity_config": {"format": "sparse-bitmask"}}, "sparse or transformed"),
        ({"surprise": 1}, "unknown compressed-tensors settings"),
    ):
        (target / "config.json").write_text(
            json.dumps({**config, "quantization_config": {**quant, **change}})
        )
        with pytest.raises(ConfigError, match=message):
            LLM(str(target), dtype="float32", disable_log_stats=True)
