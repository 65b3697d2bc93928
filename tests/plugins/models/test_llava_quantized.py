"""A quantized tiny LLaVA: quantization applies to the language model only, its vision
tower and projector stay float modules. A GPTQ checkpoint that leaves the tower in floats
(as AutoGPTQ writes vision-language models, and as vLLM reads gptq ones: it skips the
tower) answers as transformers does with the dequantized text weights; one whose tower is
quantized is refused naming the method and the tower (it was a bare unknown-weight error);
``--quantization fp8`` on the float checkpoint quantizes the text model's layers only."""

from __future__ import annotations

import pytest
import torch
from int4_writer import _write

pytest.importorskip("PIL")

from tiny_llava import LlavaReference, llava_llm, make_image

from pagedllm import SamplingParams
from pagedllm.core.errors import ConfigError

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
NEW_TOKENS = 8


def tower_dtypes(llm) -> set[torch.dtype]:
    model = llm.llm_engine.loaded.model
    modules = (model.vision_tower, model.multi_modal_projector)
    return {p.dtype for m in modules for p in m.parameters()}


def greedy(llm, image) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_gptq_llava_with_a_float_tower_matches_the_dequantized_reference(
    llava_checkpoint, tmp_path
):
    target = tmp_path / "gptq"
    dequantized = _write(llava_checkpoint, target, "gptq", 32, keep_float=("vision_tower.",))
    assert dequantized and all(n.startswith("language_model.") for n in dequantized)
    llm = llava_llm(target)
    model = llm.llm_engine.loaded.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    assert tower_dtypes(llm) == {torch.float32}
    llava_reference = LlavaReference(llava_checkpoint)
    with torch.no_grad():
        for name, weight in dequantized.items():
            module = name.removesuffix(".weight").replace(
                "language_model.model.", "model.language_model.", 1
            )
            llava_reference.model.get_submodule(module).weight.copy_(weight)
    image = make_image(2)
    assert greedy(llm, image) == llava_reference.greedy(PROMPT, [image], NEW_TOKENS)
    llm.llm_engine.shutdown()


def test_a_quantized_vision_tower_is_refused_naming_the_method_and_the_tower(
    llava_checkpoint, tmp_path
):
    target = tmp_path / "gptq-tower"
    dequantized = _write(llava_checkpoint, target, "gptq", 32)
    assert any(n.startswith("vision_tower.") for n in dequantized)
    with pytest.raises(ConfigError, match=r"--quantization gptq: .*vision tower is quantized"):
        llava_llm(target)


def test_fp8_at_load_quantizes_the_text_model_only(llava_checkpoint):
    llm = llava_llm(llava_checkpoint, quantization="fp8")
    model = llm.llm_engine.loaded.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert tower_dtypes(llm) == {torch.float32}
    assert len(greedy(llm, make_image(1))) == NEW_TOKENS
    llm.llm_engine.shutdown()
