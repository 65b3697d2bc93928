"""fp8 weights (``--quantization fp8`` / ``fbgemm_fp8``): the kernels against their torch
reference, quantization at load, and fp8 checkpoints (per-tensor, per-channel and
block-wise scales) written here in the published layouts. Weight-only on the CPU, so
greedy tokens match transformers running the dequantized weights exactly (float32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kernel_checks import OTHER_VECTOR_PATHS, build_variant
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.kernels import fp8 as k
from pagedllm.plugins.quantization.fp8 import Fp8FusedLinear

FP8 = torch.float8_e4m3fn
PROMPTS = [[1, 5, 9, 23, 42, 77, 3], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10
# Layers the checkpoints below leave in floats (as ``ignored_layers`` lists them).
IGNORED = "model.layers.1.mlp.down_proj"


# ----------------------------------------------------------------------------- kernels


def test_every_e4m3_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # (the two NaNs)
    weight = codes.view(FP8).reshape(2, -1).contiguous()
    ones = torch.ones(2, 1)
    k_ = weight.shape[1]
    assert torch.equal(k.dequantize_fp8(weight, ones, k_, torch.float32), weight.float())
    # The product kernel decodes the same way: identity activations read the columns.
    eye = torch.eye(k_)[:8]
    assert torch.equal(k.fp8_linear(eye, weight, ones, k_), weight.float()[:, :8].T)


@pytest.mark.parametrize(
    ("n", "k_", "group"), [(96, 64, 64), (300, 200, 128), (17, 33, 33), (5, 1000, 7)]
)
def test_kernels_match_the_reference(n, k_, group):
    torch.manual_seed(n)
    weight = (torch.randn(n, k_) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(n, -(-k_ // group)) / 400 + 1e-3
    for dtype in (torch.float32, torch.bfloat16):
        # Decoding is exact, so the kernel and the reference agree bit for bit.
        assert torch.equal(
            k.dequantize_fp8(weight, scale, group, dtype),
            k.dequantize_fp8_reference(weight, scale, group, dtype),
        )
    bias = torch.randn(n)
    for rows in (1, 2, 3, 5, 8, 9, 40):  # the product kernel, then decode + GEMM
        x = torch.randn(rows, k_)
        ours = k.fp8_linear(x, weight, scale, group, bias)
        torch.testing.assert_close(
            ours, k.fp8_linear_reference(x, weight, scale, group, bias), rtol=1e-5, atol=1e-5
        )
    x = torch.randn(2, 3, k_, dtype=torch.bfloat16)  # leading dims and bfloat16 kept
    ours = k.fp8_linear(x, weight, scale, group)
    assert ours.shape == (2, 3, n) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(
        ours.float(), k.fp8_linear_reference(x.float(), weight, scale, group), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("flags", OTHER_VECTOR_PATHS.values(), ids=OTHER_VECTOR_PATHS.keys())
def test_other_vector_paths(tmp_path, flags):
    """The AVX2 and plain-C paths of the product kernel, built here with AVX-512 (and
    AVX2) switched off, against the reference: a machine of the other kind runs them."""
    lib = k._Fp8Kernels(build_variant(tmp_path, "fp8_cpu.c", flags)).lib
    torch.manual_seed(1)
    n, k_, group = 37, 300, 128  # (vectors, then a tail in every group)
    weight = (torch.randn(n, k_) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(n, 3) / 400 + 1e-3
    for rows in (1, 4, 8):
        x = torch.randn(rows, k_)
        y = torch.empty(rows, n)
        status = lib.pagedllm_fp8_gemv(
            x.data_ptr(),
            rows,
            k_,
            weight.view(torch.uint8).data_ptr(),
            scale.data_ptr(),
            n,
            3,
            group,
            y.data_ptr(),
            2,
        )
        assert status == 0
        expected = k.fp8_linear_reference(x, weight, scale, group)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_scales_that_do_not_fit_are_refused():
    weight = torch.zeros(4, 10, dtype=FP8)
    with pytest.raises(ValueError, match="do not fit"):
        k.fp8_linear(torch.zeros(1, 10), weight, torch.ones(4, 3), 5)
    with pytest.raises(TypeError):
        k.fp8_linear(torch.zeros(1, 10), weight.float(), torch.ones(4, 1), 10)


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_fp8(per_channel):
    torch.manual_seed(0)
    weight = torch.randn(32, 64) * torch.linspace(0.1, 3, 32)[:, None]
    weight[3] = 0  # an all-zero row keeps a usable scale
    quantized, scale = k.quantize_fp8(weight, per_channel)
    assert quantized.dtype == FP8 and scale.shape == (32, 1)
    # The largest magnitude (of each row, or of the tensor) maps onto 448.
    peaks = quantized.float().abs().amax(dim=1)
    if per_channel:
        assert torch.equal(peaks[weight.abs().amax(dim=1) > 0], torch.full((31,), 448.0))
        assert scale[3].item() == 1.0  # (an all-zero row)
    else:
        assert peaks.max().item() == 448.0 and scale.unique().numel() == 1
    # e4m3 keeps 3 mantissa bits: relative error within 2^-4, or the subnormals' step.
    restored = quantized.float() * scale
    assert ((restored - weight).abs() <= weight.abs() / 16 + scale * 2**-9).all()


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=3)


def _quantized_linears(model) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in name
    ]


def _assert_matches(llm: LLM, reference) -> None:
    assert_matches_reference(llm, reference, PROMPTS, NEW_TOKENS, tolerance=1e-3)


def _logprobs(llm: LLM) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0]
    return [step[token].logprob for step, token in zip(out.logprobs, out.token_ids, strict=True)]


@pytest.mark.parametrize(("method", "per_channel"), [("fp8", False), ("fbgemm_fp8", True)])
def test_quantized_at_load(float_checkpoint, method, per_channel):
    """A float checkpoint quantized at load (per tensor for fp8, per row for fbgemm_fp8)
    runs as transformers does with those very weights, dequantized: token for token."""
    llm = LLM(str(float_checkpoint), quantization=method, dtype="float32", disable_log_stats=True)
    model = llm.llm_engine.loaded.model
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == FP8 and attn.o_proj.weight.dtype == FP8
    fused = [m for m in model.modules() if isinstance(m, Fp8FusedLinear)]
    assert fused and all(m.weight.dtype == FP8 for m in fused)
    # Q, K and V are row slices of the fused weight (nothing stored twice).
    assert attn.q_proj.weight.data_ptr() == fused[0].weight.data_ptr()
    assert model.model.embed_tokens.weight.dtype == torch.float32  # (embedding: floats)

    reference = load_reference(float_checkpoint)
    floats = _logprobs(llm)
    with torch.no_grad():
        for name in _quantized_linears(reference):
            linear = reference.get_submodule(name)
            weight = linear.weight.float()
            amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
            scale = amax / 448.0
            linear.weight.copy_((weight / scale).clamp(-448, 448).to(FP8).float() * scale)
    _assert_matches(llm, reference)
    # (and quantization changed the numbers: the float model gives other logprobs)
    plain = LLM(str(float_checkpoint), dtype="float32", disable_log_stats=True)
    assert max(abs(a - b) for a, b in zip(floats, _logprobs(plain), strict=True)) > 1e-4


def _write_fp8_checkpoint(
    source: Path,
    target: Path,
    *,
    per_channel: bool = False,
    block: tuple[int, int] | None = None,
    static: bool = False,
    kv_scales: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """``source``'s decoder weights in fp8 as the published layouts store them (vLLM /
    AutoFP8 per tensor, FBGEMM per row, transformers' fine-grained fp8 per block), every
    layer but ``IGNORED``; returns the dequantized weights (the formats' own recipe:
    ``weight * scale`` over the scale's tensor, row or block)."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        if ".layers." not in name or tensor.dim() != 2 or base == IGNORED:
            out[name] = tensor
            continue
        w = tensor.float()
        if block is not None:
            rows, cols = block
            n, k_ = w.shape
            padded = torch.zeros(-(-n // rows) * rows, -(-k_ // cols) * cols)
            padded[:n, :k_] = w
            tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k_]
            q = (w / full).clamp(-448, 448).to(FP8)
            out[name], out[f"{base}.weight_scale_inv"] = q, scale
            dequantized[name] = q.float() * full
            continue
        if per_channel:
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        else:
            scale = w.abs().amax() / 448.0
        q = (w / scale).clamp(-448, 448).to(FP8)
        out[name], out[f"{base}.weight_scale"] = q, scale
        if static:
            out[f"{base}.input_scale"] = torch.tensor(0.02)
        dequantized[name] = q.float() * scale
    for name, value in (kv_scales or {}).items():  # (an fp8 KV cache's, per layer)
        out[name] = torch.tensor(value)
    (target / "model.safetensors").unlink()
    save_file(out, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    if per_channel:
        quant = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
        quant["modules_to_not_convert"] = [IGNORED, "lm_head"]
    else:
        quant = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
        quant["ignored_layers"] = [IGNORED]
        if block is not None:
            quant["weight_block_size"] = list(block)
        if kv_scales:
            quant["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize(
    "layout",
    [
        {"static": True},  # per tensor, with input scales
        {"per_channel": True},  # fbgemm_fp8
        {"block": (48, 48)},  # block-wise, with partial blocks (64 and 128 wide)
    ],
    ids=["per-tensor", "per-channel", "block"],
)
def test_fp8_checkpoints(float_checkpoint, tmp_path, layout):
    target = tmp_path / "fp8"
    dequantized = _write_fp8_checkpoint(float_checkpoint, target, **layout)
    llm = LLM(str(target), dtype="float32", disable_log_stats=True)  # (--quantization auto)
    model = llm.llm_engine.loaded.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # (ignored)
    reference = load_reference(float_checkpoint)
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
    _assert_matches(llm, reference)


def test_kv_cache_scales_from_the_checkpoint(float_checkpoint, tmp_path):
    """A checkpoint quantized for an fp8 KV cache carries each layer's key and value
    scales, in both names they are written under; --kv-cache-dtype fp8 uses them (and
    --calculate-kv-scales replaces them), a model-dtype cache does not need them."""
    scales = {
        "model.layers.0.self_attn.k_scale": 0.011,
        "model.layers.0.self_attn.v_scale": 0.013,
        "model.layers.1.self_attn.k_proj.output_scale": 0.017,
        "model.layers.1.self_attn.v_proj.output_scale": 0.019,
    }
    target = tmp_path / "fp8"
    _write_fp8_checkpoint(float_checkpoint, target, kv_scales=scales)

    def layer_scales(llm) -> list[float]:
        model = llm.llm_engine.loaded.model
        attention = [layer.self_attn.attn for layer in model.model.layers]
        return [scale for attn in attention for scale in (attn.k_scale, attn.v_scale)]

    stored = [torch.tensor(value).item() for value in scales.values()]  # (as float32)
    fp8 = LLM(str(target), dtype="float32", kv_cache_dtype="fp8", disable_log_stats=True)
    assert layer_scales(fp8) == stored
    assert fp8.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs
    auto = LLM(str(target), dtype="float32", disable_log_stats=True)
    assert layer_scales(auto) == [1.0] * 4
    computed = LLM(
        str(target),
        dtype="float32",
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
        disable_log_stats=True,
    )
    computed.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert not set(stored) & set(layer_scales(computed))
    # A scale for an attention the model does not have is an error naming it.
    stray = tmp_path / "stray"
    _write_fp8_checkpoint(
        float_checkpoint, stray, kv_scales={"model.layers.7.self_attn.k_scale": 0.01}
    )
    with pytest.raises(ConfigError, match=r"KV-cache scale 'model\.layers\.7"):
        LLM(str(stray), dtype="float32", kv_cache_dtype="fp8", disable_log_stats=True)


def test_settings_it_cannot_read_are_refused(float_checkpoint, tmp_path):
    target = tmp_path / "fp8"
    _write_fp8_checkpoint(float_checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    for change, message in (
        ({"fmt": "e5m2"}, "only e4m3"),
        ({"activation_scheme": "per-token"}, "activation_scheme"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"kv_cache_schema": {}}, "unknown fp8 settings"),
    ):
        quant = {**config["quantization_config"], **change}
        (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ConfigError, match=message):
            LLM(str(target), dtype="float32", disable_log_stats=True)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantized with 'fp8'"):
        LLM(str(target), quantization="fbgemm_fp8", dtype="float32", disable_log_stats=True)
