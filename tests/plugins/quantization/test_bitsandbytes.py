"""bitsandbytes weights (``--quantization bitsandbytes``, ``--load-format bitsandbytes``):
the kernels against their torch reference, checkpoints written by transformers with the
bitsandbytes library itself (4-bit NF4 with double quantization, FP4, 8-bit LLM.int8), and
4-bit NF4 quantization at load. The weights decode exactly to bitsandbytes' values, so
greedy tokens equal transformers running the dequantized weights (float32), and 4-bit
models equal transformers' own bitsandbytes model computing in float32.

Run as bitsandbytes runs it by default on this host, transformers' model is not float32:
on a CPU with AVX512-BF16, bitsandbytes' 4-bit layers take a fused kernel that rounds
activations and absmax to bfloat16 whatever ``bnb_4bit_compute_dtype`` says (logits about
1e-2 off float32), and LLM.int8 rounds activations to 8 bits (pagedllm is weight-only).
Against those, tokens agree until the reference's own top-2 logit gap is within its
rounding (:func:`_assert_same_until_a_near_tie`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kernel_checks import OTHER_VECTOR_PATHS, build_variant
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.kernels import bnb as k
from pagedllm.kernels.quant_layouts import read_4bit

transformers = pytest.importorskip("transformers")
bnb_functional = pytest.importorskip("bitsandbytes.functional")
bnb_nn = pytest.importorskip("bitsandbytes.nn")

PROMPTS = [[1, 5, 9, 23, 42, 77, 3], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10
# A layer the FP4 checkpoint leaves in floats (``llm_int8_skip_modules``).
SKIPPED = "model.layers.1.mlp.down_proj"
# Logit gaps within which bitsandbytes' own rounding (bfloat16 in 4-bit layers on
# AVX512-BF16 CPUs, 8-bit activations in LLM.int8) may swap the top two tokens: twice the
# largest deviation from float32 its logits are allowed (measured: 0.016 and 0.029).
NEAR_TIE = {"nf4": 0.05, "fp4": 0.05, "int8": 0.1}


# ----------------------------------------------------------------------------- kernels


def _random_4bit(n: int, k_: int, groups: int, seed: int):
    torch.manual_seed(seed)
    packed = torch.randint(0, 256, (n, k_ // 2), dtype=torch.uint8)
    return packed, torch.rand(n, groups) + 0.05, torch.randn(16)


@pytest.mark.parametrize(("n", "k_", "groups"), [(96, 64, 1), (300, 256, 4), (17, 1024, 2)])
def test_4bit_kernels_match_the_reference(n, k_, groups):
    packed, absmax, code = _random_4bit(n, k_, groups, seed=n)
    for dtype in (torch.float32, torch.bfloat16):  # decoding is exact: bit for bit
        assert torch.equal(
            k.dequantize_4bit(packed, absmax, code, dtype),
            k.dequantize_4bit_reference(packed, absmax, code, dtype),
        )
    bias = torch.randn(n)
    for rows in (1, 2, 3, 5, 8, 9, 40):  # the product kernel, then decode + GEMM
        x = torch.randn(rows, k_)
        torch.testing.assert_close(
            k.linear_4bit(x, packed, absmax, code, bias),
            k.linear_4bit_reference(x, packed, absmax, code, bias),
            rtol=1e-5,
            atol=1e-4,
        )
    x = torch.randn(2, 3, k_, dtype=torch.bfloat16)  # leading dims and bfloat16 kept
    out = k.linear_4bit(x, packed, absmax, code)
    assert out.shape == (2, 3, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), k.linear_4bit_reference(x.float(), packed, absmax, code), rtol=2e-2, atol=5e-2
    )


def test_int8_kernel_matches_the_reference():
    torch.manual_seed(2)
    q = torch.randint(-127, 128, (70, 200), dtype=torch.int8)
    scale = k.int8_row_scale(torch.rand(70) * 3)
    bias = torch.randn(70)
    for rows in (1, 4, 8, 9, 33):
        x = torch.randn(rows, 200)
        torch.testing.assert_close(
            k.linear_int8(x, q, scale, bias),
            k.linear_int8_reference(x, q, scale, bias),
            rtol=1e-5,
            atol=1e-4,
        )
    for dtype in (torch.float32, torch.bfloat16):  # (a column tail past the vectors)
        q3 = torch.randint(-128, 128, (70, 203), dtype=torch.int8)
        assert torch.equal(
            k.dequantize_int8(q3, scale, dtype), k.dequantize_int8_reference(q3, scale, dtype)
        )
    with pytest.raises(ValueError, match="int8"):
        k.linear_int8(torch.zeros(1, 200), q.float(), scale)


@pytest.mark.parametrize("flags", OTHER_VECTOR_PATHS.values(), ids=OTHER_VECTOR_PATHS.keys())
def test_other_vector_paths(tmp_path, flags):
    """The AVX2 and plain-C paths of the product kernels, built here with AVX-512 (and
    AVX2) switched off, against the reference: a machine of the other kind runs them."""
    lib = k._BnbKernels(build_variant(tmp_path, "bnb_cpu.c", flags)).lib
    packed, absmax, code = _random_4bit(37, 256, 4, seed=5)
    q = torch.randint(-127, 128, (37, 200), dtype=torch.int8)
    scale = k.int8_row_scale(torch.rand(37))
    for rows in (1, 4, 8):
        x = torch.randn(rows, 256)
        y = torch.empty(rows, 37)
        status = lib.pagedllm_bnb4_gemv(
            x.data_ptr(), rows, 256, packed.data_ptr(), absmax.data_ptr(), code.data_ptr(),
            37, 4, 64, y.data_ptr(), 2,
        )  # fmt: skip
        assert status == 0
        expected = k.linear_4bit_reference(x, packed, absmax, code)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
        x = torch.randn(rows, 200)  # (vectors, then a tail)
        status = lib.pagedllm_int8_gemv(
            x.data_ptr(), rows, 200, q.data_ptr(), scale.data_ptr(), 37, y.data_ptr(), 2
        )
        assert status == 0
        torch.testing.assert_close(y, k.linear_int8_reference(x, q, scale), rtol=1e-5, atol=1e-4)
    for dtype in (torch.float32, torch.bfloat16):  # decoding: bit for bit
        out = torch.empty(37, 256, dtype=dtype)
        bf16 = int(dtype == torch.bfloat16)
        lib.pagedllm_bnb4_dequant(
            packed.data_ptr(), absmax.data_ptr(), code.data_ptr(), 37, 256, 4, 64,
            out.data_ptr(), bf16, 2,
        )  # fmt: skip
        assert torch.equal(out, k.dequantize_4bit_reference(packed, absmax, code, dtype))
        out = torch.empty(37, 200, dtype=dtype)
        lib.pagedllm_int8_dequant(q.data_ptr(), scale.data_ptr(), 37, 200, out.data_ptr(), bf16, 2)
        assert torch.equal(out, k.dequantize_int8_reference(q, scale, dtype))


# ------------------------------------------------------------------------- checkpoints


def _bnb_config(kind: str):
    if kind == "nf4":
        return transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    if kind == "fp4":
        return transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_compute_dtype=torch.float32,
            llm_int8_skip_modules=["lm_head", SKIPPED],
        )
    return transformers.BitsAndBytesConfig(load_in_8bit=True)


def _bnb_model(source: Path, kind: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, quantization_config=_bnb_config(kind)
    )
    return model.eval()


def _saved_bnb_model(directory: Path):
    """transformers' bitsandbytes model of a saved checkpoint, as bitsandbytes runs it on
    this host."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _assert_float32_bnb_is(directory: Path, dequantized) -> None:
    """transformers' bitsandbytes model of ``directory`` computing in the checkpoint's
    compute dtype, float32 (bitsandbytes' AVX512-BF16 CPU kernel, which rounds to bfloat16,
    switched off: ``Linear4bit.support_avx512bf16_for_cpu``), gives ``dequantized``'s
    logits: so matching that model is matching transformers' bitsandbytes model."""
    model = _saved_bnb_model(directory)
    layers = [m for m in model.modules() if isinstance(m, bnb_nn.Linear4bit)]
    assert layers
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    for prompt in PROMPTS:
        sequence = torch.tensor([prompt])
        torch.testing.assert_close(model(sequence).logits, dequantized(sequence).logits)


@torch.no_grad()
def _assert_same_until_a_near_tie(
    llm: LLM, model, exact, prompts: list[list[int]], tie: float, new_tokens: int = NEW_TOKENS
) -> int:
    """``llm``'s greedy tokens are those of ``model`` (a bitsandbytes model run as
    bitsandbytes runs it here) up to the first step where ``model``'s top-2 logit gap is
    below ``tie``; there they may part. ``model``'s logits stay within ``tie / 2`` of
    ``exact`` (the float32 computation of the same weights), so such a gap is within its
    rounding. Returns how many prompts parted so."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    parted = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = list(output.outputs[0].token_ids)
        result = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        theirs = result.sequences[0, len(prompt) :].tolist()
        sequence = torch.tensor([prompt + theirs[:-1]])
        deviation = (model(sequence).logits - exact(sequence).logits).abs().max().item()
        assert deviation < tie / 2, f"bitsandbytes' logits {deviation} off float32"
        for step, (mine, token) in enumerate(zip(ours, theirs, strict=True)):
            if mine != token:
                top2 = result.logits[step][0].float().topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < tie, f"{prompt}: step {step}, {mine} for {token} at gap {gap}"
                parted += 1
                break
    return parted


def _dequantized(directory: Path):
    """transformers' bitsandbytes model of ``directory`` with its weights dequantized by
    bitsandbytes (``model.dequantize()``): a float model with the quantized values."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.dequantize()
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A float Qwen2 (untied head, biases) and its bitsandbytes checkpoints, each saved by
    transformers with the bitsandbytes library."""
    root = tmp_path_factory.mktemp("bnb")
    source = make_checkpoint(root / "float", "qwen2", seed=1)
    out = {"float": source}
    for kind in ("nf4", "fp4", "int8"):
        target = root / kind
        _bnb_model(source, kind).save_pretrained(target)
        for file in source.iterdir():  # the tokenizer
            if file.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(file, target / file.name)
        out[kind] = target
    return out


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", disable_log_stats=True, **kwargs)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_4bit_checkpoints(checkpoints, kind):
    """transformers' 4-bit checkpoints (found by their quantization_config; the load format
    follows) run as transformers runs them in float32: the same tokens as its dequantized
    weights, which are its bitsandbytes model's in float32, logprobs included; as
    bitsandbytes runs by default here, the same until a near tie."""
    llm = _llm(checkpoints[kind])
    model = llm.llm_engine.loaded.model
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.uint8 and attn.q_proj.weight.shape == (64, 32)
    skipped = model.get_submodule(SKIPPED)
    assert (skipped.method is None) == (kind == "fp4")
    assert model.lm_head.method is None
    dequantized = _dequantized(checkpoints[kind])
    _assert_float32_bnb_is(checkpoints[kind], dequantized)
    assert_matches_reference(llm, dequantized, PROMPTS, NEW_TOKENS, 1e-3)
    bnb_model = _saved_bnb_model(checkpoints[kind])
    _assert_same_until_a_near_tie(llm, bnb_model, dequantized, PROMPTS, NEAR_TIE[kind])


@pytest.fixture(scope="module")
def llama_nf4(tmp_path_factory) -> Path:
    """A tiny Llama (tied head) saved by transformers as plain NF4 (no double
    quantization), one whose greedy tokens bitsandbytes' bfloat16 CPU kernel swaps."""
    root = tmp_path_factory.mktemp("bnb_llama")
    source = make_checkpoint(root / "float", "llama", seed=10)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, quantization_config=config
    )
    model.save_pretrained(root / "nf4")
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, root / "nf4" / file.name)
    return root / "nf4"


def test_4bit_llama_parts_from_bitsandbytes_only_at_near_ties(llama_nf4):
    """Exactly transformers' bitsandbytes model computing in float32 (the checkpoint's
    compute dtype); by default on an AVX512-BF16 CPU, bitsandbytes computes in bfloat16
    and the third prompt's first token is a near tie it settles the other way (top-2 gap
    1.4e-3, its logits 1.4e-2 off float32)."""
    prompts = [*PROMPTS, [215, 423, 437, 111, 383, 329, 380, 231, 329]]
    llm = _llm(llama_nf4)
    dequantized = _dequantized(llama_nf4)
    _assert_float32_bnb_is(llama_nf4, dequantized)
    assert_matches_reference(llm, dequantized, prompts, NEW_TOKENS, 1e-3)
    bnb_model = _saved_bnb_model(llama_nf4)
    parted = _assert_same_until_a_near_tie(llm, bnb_model, dequantized, prompts, NEAR_TIE["nf4"])
    assert parted <= 1


@pytest.mark.parametrize("kind", ["nf4", "fp4", "llama"])
def test_decoding_is_bitsandbytes_own(checkpoints, llama_nf4, kind):
    """Every 4-bit layer's pagedllm tensors decode to exactly what bitsandbytes'
    dequantize_4bit gives for the saved state (double-quantized absmax included)."""
    directory = llama_nf4 if kind == "llama" else checkpoints[kind]
    tensors = load_file(directory / "model.safetensors")
    layers = [n for n, t in tensors.items() if n.endswith(".weight") and t.dtype == torch.uint8]
    assert len(layers) == 14 - (kind == "fp4")
    for prefix in layers:
        parts = {"weight": tensors[prefix]}
        parts |= {n[len(prefix) + 1 :]: t for n, t in tensors.items() if n.startswith(prefix + ".")}
        assert ("nested_absmax" in parts) == (kind == "nf4")
        state = bnb_functional.QuantState.from_dict(
            {name: t for name, t in parts.items() if name != "weight"}, device=torch.device("cpu")
        )
        expected = bnb_functional.dequantize_4bit(parts["weight"], state)
        ours = read_4bit(prefix, parts)
        got = k.dequantize_4bit(
            ours["weight"], ours["weight_absmax"], ours["weight_code"], torch.float32
        )
        assert torch.equal(got, expected), prefix


def test_8bit_checkpoint(checkpoints):
    """An LLM.int8 checkpoint: exactly transformers with the dequantized weights; and
    transformers' bitsandbytes model (8-bit activations): logprobs within a tolerance, the
    same tokens until a near tie."""
    llm = _llm(checkpoints["int8"])
    assert llm.llm_engine.loaded.model.model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    dequantized = _dequantized(checkpoints["int8"])
    assert_matches_reference(llm, dequantized, PROMPTS, NEW_TOKENS, 1e-3)
    bnb_model = _saved_bnb_model(checkpoints["int8"])
    _assert_same_until_a_near_tie(llm, bnb_model, dequantized, PROMPTS, NEAR_TIE["int8"])
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        _, top = reference_greedy(bnb_model, prompt, 1, num_logprobs=5)
        ours = output.outputs[0].logprobs[0]
        assert next(iter(top[0])) == output.outputs[0].token_ids[0]
        for token, logprob in top[0].items():
            assert abs(ours[token].logprob - logprob) < 0.05


def test_quantized_at_load(checkpoints):
    """``--quantization bitsandbytes`` on a float checkpoint: 4-bit NF4 with double
    quantization, the very bytes transformers' bitsandbytes quantization makes."""
    llm = _llm(checkpoints["float"], quantization="bitsandbytes")
    ours = llm.llm_engine.loaded.model.model.layers[1].self_attn.o_proj
    theirs = load_file(checkpoints["nf4"] / "model.safetensors")
    assert torch.equal(ours.weight, theirs["model.layers.1.self_attn.o_proj.weight"].view(64, 32))
    dequantized = _dequantized(checkpoints["nf4"])
    assert_matches_reference(llm, dequantized, PROMPTS, NEW_TOKENS, 1e-3)
    bnb_model = _saved_bnb_model(checkpoints["nf4"])
    _assert_same_until_a_near_tie(llm, bnb_model, dequantized, PROMPTS, NEAR_TIE["nf4"])


def test_load_format_and_method_go_together(checkpoints):
    with pytest.raises(ConfigError, match="--load-format bitsandbytes"):
        _llm(checkpoints["nf4"], load_format="safetensors")
    with pytest.raises(ConfigError, match="--quantization bitsandbytes"):
        _llm(checkpoints["float"], load_format="bitsandbytes")
    # --quantization auto (as unset) finds the method in the checkpoint's config.
    auto = _llm(checkpoints["int8"], quantization="auto")
    assert auto.llm_engine.loaded.model.model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    # Explicitly named, both work.
    llm = _llm(checkpoints["nf4"], quantization="bitsandbytes", load_format="bitsandbytes")
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)[0].outputs[0].text


def test_incomplete_layers_are_refused(checkpoints, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["nf4"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight.absmax"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ConfigError, match="model.layers.0.mlp.up_proj has"):
        _llm(broken)


def test_unsupported_settings_are_refused(checkpoints, tmp_path):
    for change, message in [
        ({"llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight"),
        ({"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
        ({"new_setting": 1}, "new_setting"),
    ]:
        target = tmp_path / message
        shutil.copytree(checkpoints["nf4"], target)
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"].update(change)
        (target / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=message):
            _llm(target)


def test_qlora_adapter_chooses_the_quantized_layers(checkpoints, tmp_path):
    """``--qlora-adapter-name-or-path``: a LoRA adapter saved by peft names the layers
    quantized at load (its target_modules); the rest stay in floats. Tokens equal
    transformers with bitsandbytes' NF4 values in exactly those layers."""
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["float"])
    adapter = tmp_path / "adapter"
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"])
    peft.get_peft_model(base, lora).save_pretrained(adapter)
    llm = _llm(
        checkpoints["float"], quantization="bitsandbytes", qlora_adapter_name_or_path=str(adapter)
    )
    model = llm.llm_engine.loaded.model
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["float"], dtype=torch.float32
    )
    quantized = []
    for name, module in reference.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        ours = model.get_submodule(name)
        if name.rsplit(".", 1)[-1] not in ("q_proj", "v_proj", "up_proj"):
            assert ours.method is None and ours.weight.dtype == torch.float32
            continue
        quantized.append(name)
        assert ours.weight.dtype == torch.uint8
        with torch.no_grad():
            packed, state = bnb_functional.quantize_4bit(
                module.weight.data.contiguous(), blocksize=64, compress_statistics=True,
                quant_type="nf4",
            )  # fmt: skip
            module.weight.copy_(bnb_functional.dequantize_4bit(packed, state))
    assert len(quantized) == 6
    assert_matches_reference(llm, reference.eval(), PROMPTS, NEW_TOKENS, 1e-3)
    with pytest.raises(ConfigError, match="--quantization bitsandbytes"):
        _llm(checkpoints["float"], qlora_adapter_name_or_path=str(adapter))
    with pytest.raises(ConfigError, match="already quantized"):
        _llm(checkpoints["nf4"], qlora_adapter_name_or_path=str(adapter))
