"""GPTQ and AWQ 4-bit checkpoints (``--quantization gptq`` / ``awq``, detected from
``quantization_config``), written here in AutoGPTQ's and AutoAWQ's published layouts
(neither tool runs on this CPU) and checked by dequantizing with their recipe. The weights
are repacked exactly, so greedy tokens equal transformers' with the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.ggml_types import GGMLQuantizationType
from pagedllm.plugins.quantization.int4 import AWQ_ORDER

PROMPTS = [[1, 5, 9, 23, 42, 77, 3], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10
IGNORED = "model.layers.1.mlp.down_proj"


def _pack(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit ``values`` packed eight to an int32 along ``dim``: nibble j of each int32
    holds element ``order[j]`` of its run of eight (lowest bits first)."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    packed = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        packed |= v[..., j] << (4 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _quantize(w: torch.Tensor, groups: torch.Tensor, ngroups: int, sym: bool):
    """Round-to-nearest 4-bit quantization of ``w`` ``[out, in]`` by input groups: ``(q
    [in, out], zeros [groups, out], scales fp16 [groups, out])``."""
    wt = w.T.float()  # [in, out]
    scales = torch.empty(ngroups, w.shape[0])
    zeros = torch.empty(ngroups, w.shape[0], dtype=torch.int64)
    for g in range(ngroups):
        rows = wt[groups == g]
        if sym:
            scale = rows.abs().amax(0) / 7.5
            zero = torch.full_like(scale, 8, dtype=torch.int64)
        else:
            lo, hi = rows.amin(0), rows.amax(0)
            scale = (hi - lo) / 15
            zero = (-lo / scale).round().clamp(0, 15).to(torch.int64)
        scales[g], zeros[g] = scale.half().float(), zero
    q = (wt / scales[groups] + zeros[groups]).round().clamp(0, 15).to(torch.int64)
    return q, zeros, scales.half()


def _write(source: Path, target: Path, method: str, group: int, sym=True, act_order=False):
    """``source``'s decoder weights (but ``IGNORED``) as a GPTQ or AWQ checkpoint, and the
    weights that layout dequantizes to (``scale * (q - zero)``, in float32)."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    out, dequantized = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        if ".layers." not in name or tensor.dim() != 2 or base == IGNORED:
            out[name] = tensor
            continue
        in_features = tensor.shape[1]
        size = in_features if group == -1 else group
        ngroups = in_features // size
        order = torch.arange(in_features)
        if act_order:  # columns quantized in another order: groups follow it
            order = torch.randperm(in_features, generator=generator)
        groups = torch.empty(in_features, dtype=torch.int64)
        groups[order] = torch.arange(in_features) // size
        q, zeros, scales = _quantize(tensor, groups, ngroups, sym)
        dequantized[name] = ((q - zeros[groups]).float() * scales[groups].float()).T
        if method == "gptq":
            out[f"{base}.qweight"] = _pack(q, 0)
            out[f"{base}.qzeros"] = _pack(zeros - 1, 1)  # (v1 layout: zero minus one)
            out[f"{base}.scales"] = scales
            out[f"{base}.g_idx"] = groups.to(torch.int32)
        else:
            out[f"{base}.qweight"] = _pack(q, 1, AWQ_ORDER)
            out[f"{base}.qzeros"] = _pack(zeros, 1, AWQ_ORDER)
            out[f"{base}.scales"] = scales
    (target / "model.safetensors").unlink()
    save_file(out, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    if method == "gptq":
        quant = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": sym,
            "damp_percent": 0.01,
            "true_sequential": True,
            "checkpoint_format": "gptq",
            "modules_to_not_convert": [IGNORED],
        }
    else:
        quant = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": [IGNORED],
        }
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    return dequantized


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
