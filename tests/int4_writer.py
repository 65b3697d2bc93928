"""GPTQ and AWQ 4-bit checkpoints written in AutoGPTQ's and AutoAWQ's published layouts
(neither tool runs on this CPU), for the tests that load them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm.plugins.quantization.int4 import AWQ_ORDER

# A layer the written checkpoints leave unquantized (modules_to_not_convert).
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


def _write(
    source: Path,
    target: Path,
    method: str,
    group: int,
    sym=True,
    act_order=False,
    keep_float: tuple[str, ...] = (),
):
    """``source``'s decoder weights (but ``IGNORED`` and those under ``keep_float``) as a
    GPTQ or AWQ checkpoint, and the weights that layout dequantizes to (``scale * (q -
    zero)``, in float32)."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    out, dequantized = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        if (
            ".layers." not in name
            or tensor.dim() != 2
            or base.endswith(IGNORED)
            or name.startswith(keep_float)
        ):
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
