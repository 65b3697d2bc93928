"""Every GGUF architecture pagedllm maps (llama, qwen2, qwen3, gemma3, phi3): a tiny
``transformers`` checkpoint written as GGUF the way llama.cpp converts it, loaded with its
weights packed, gives ``transformers``' greedy tokens (on the same stored weights) and
logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_writer import gguf_checkpoint, write_gguf
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError

T = GGMLQuantizationType
NEW_TOKENS = 24

# Gemma 3 as llama.cpp describes it: every 6th layer global, local RoPE base 10000.
GEMMA3_GGUF = dict(
    num_hidden_layers=6,
    layer_types=None,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    final_logit_softcapping=None,
)

# (architecture, tiny checkpoint, config overrides, GGML type of the 2-D weights)
CASES = {
    "llama-Q4_1": ("llama", "llama", {}, T.Q4_1),
    "qwen2-Q8_0": ("qwen2", "qwen2", {}, T.Q8_0),
    "qwen3-Q5_0": ("qwen3", "qwen3", {}, T.Q5_0),
    "gemma3-Q4_0": ("gemma3", "gemma3", GEMMA3_GGUF, T.Q4_0),
    "phi3-Q5_1": ("phi3", "phi3", {}, T.Q5_1),
    "llama-F16": ("llama", "llama", {}, T.F16),
    "qwen2-F32": ("qwen2", "qwen2", {}, T.F32),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(6, 512, (n,), generator=generator).tolist() for n in (5, 19, 33)]


PROMPTS = _prompts()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, tiny, overrides, qtype = CASES[request.param]
    directory, path, model = gguf_checkpoint(
        tmp_path_factory.mktemp(tiny), arch, qtype, tiny, **overrides
    )
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return directory, path, qtype, expected


def _generate(llm: LLM) -> list:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, params, use_tqdm=False)


def _check(outputs, expected) -> None:
    for index, (output, (tokens, top)) in enumerate(zip(outputs, expected, strict=True)):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt {index}"
        for step, (ours, theirs) in enumerate(zip(completion.logprobs, top, strict=True)):
            for token_id, logprob in theirs.items():
                assert abs(ours[token_id].logprob - logprob) < 1e-4, (index, step)


def _packed(llm: LLM) -> set[str]:
    model = llm.llm_engine.loaded.model
    return {name for name, p in model.named_parameters() if p.dtype == torch.uint8}


def test_parity_with_packed_weights(case):
    directory, path, qtype, expected = case
    # No HF files next to the .gguf: config from its metadata; the tokenizer is the
    # checkpoint's (these tiny files carry none).
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", disable_log_stats=True)
    _check(_generate(llm), expected)
    packed = _packed(llm)
    if qtype == T.F32:
        assert not packed
    else:
        assert "model.embed_tokens.weight" in packed
        assert "model.layers.0.self_attn.o_proj.weight" in packed


def test_hf_config_path_override_keeps_weights_packed(case):
    directory, path, qtype, expected = case
    llm = LLM(
        str(path),
        tokenizer=str(directory),
        hf_config_path=str(directory),
        dtype="float32",
        disable_log_stats=True,
    )
    _check(_generate(llm), expected)
    assert bool(_packed(llm)) == (qtype != T.F32)


def test_dequantize_option_loads_float_weights(case):
    directory, path, _qtype, expected = case
    llm = LLM(
        str(path),
        tokenizer=str(directory),
        dtype="float32",
        disable_log_stats=True,
        model_loader_extra_config={"dequantize": True},
    )
    assert not _packed(llm)
    _check(_generate(llm), expected)


def test_quantization_flag_checks(tmp_path):
    directory = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="gguf quantization needs a GGUF checkpoint"):
        LLM(str(directory), quantization="gguf", dtype="float32")
    with pytest.raises(ConfigError, match="only apply to GGUF"):
        LLM(str(directory), model_loader_extra_config={"dequantize": True})
    model = load_reference(directory)
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, "llama", T.Q8_0)
    with pytest.raises(ConfigError, match="quantized with 'gguf'"):
        LLM(str(path), tokenizer=str(directory), quantization="dummyq")
    with pytest.raises(ConfigError, match="cannot be combined"):
        LLM(
            str(path),
            tokenizer=str(directory),
            quantization="gguf",
            model_loader_extra_config={"dequantize": True},
        )
    with pytest.raises(ConfigError, match="'dequantize' must be true or false"):
        LLM(str(path), tokenizer=str(directory), model_loader_extra_config={"dequantize": 1})


def test_sampling_metadata_gives_the_request_defaults(tmp_path):
    """llama.cpp's general.sampling.* keys are the model's sampling defaults (with
    --generation-config auto; a generation_config.json beside the file goes over them;
    --generation-config vllm reads neither)."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    model = load_reference(directory)
    sampling = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_p": 0.95,
        "general.sampling.top_k": 20,
        "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": 1.1,
        "general.sampling.mirostat": 0,  # no vLLM sampling field: left to llama.cpp
    }
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(
        folder / "llama.gguf", model.state_dict(), model.config, "llama", T.F32, sampling
    )

    def defaults(**kwargs) -> tuple:
        with LLM(str(path), tokenizer=str(directory), disable_log_stats=True, **kwargs) as llm:
            params = llm.get_default_sampling_params()
        return (
            params.temperature,
            params.top_p,
            params.top_k,
            params.min_p,
            params.repetition_penalty,
        )

    assert defaults() == (0.6, 0.95, 20, 0.05, 1.1)
    assert defaults(generation_config="vllm") == (1.0, 1.0, 0, 0.0, 1.0)
    (folder / "generation_config.json").write_text('{"temperature": 0.3}')
    assert defaults() == (0.3, 0.95, 20, 0.05, 1.1)
