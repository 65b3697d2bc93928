"""The native architectures added beside the Llama family (their parity with transformers
is tests/plugins/models/test_parity.py's): settings they do not implement are refused by name."""

from __future__ import annotations

import pytest
from test_parity import NEW_TOKENS, NUM_LOGPROBS, PROMPTS, _check
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError

REFUSED = [
    ("falcon_mqa", dict(alibi=True), "Falcon with alibi=True"),
    (
        "falcon",
        dict(parallel_attn=False),
        "Falcon with new_decoder_architecture and parallel_attn=False",
    ),
    ("phi", dict(tie_word_embeddings=True), "PhiForCausalLM with tie_word_embeddings"),
]


@pytest.mark.parametrize(("name", "overrides", "message"), REFUSED)
def test_unsupported_settings_are_refused_by_name(tmp_path, name, overrides, message):
    directory = make_checkpoint(tmp_path / name, name, **overrides)
    with pytest.raises(ConfigError, match=message):
        LLM(str(directory), dtype="float32")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_experts_load_from_transformers_fused_layout(tmp_path, name):
    """``save_pretrained`` writes one tensor per expert (what tests/plugins/models/test_parity.py
    loads); transformers' own modules hold them fused (``experts.gate_up_proj`` ``[E,
    2 * inter, hidden]``, ``experts.down_proj``), which a checkpoint may store too."""
    from safetensors.torch import save_file

    directory = make_checkpoint(tmp_path / name, name)
    reference = load_reference(directory)
    state = reference.state_dict()
    assert any(key.endswith(".mlp.experts.gate_up_proj") for key in state)
    (directory / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=NUM_LOGPROBS
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _check(outputs, [reference_greedy(reference, p, NEW_TOKENS, NUM_LOGPROBS) for p in PROMPTS])


def test_quantized_experts_are_refused_by_name(tmp_path):
    directory = make_checkpoint(tmp_path / "mixtral", "mixtral")
    with pytest.raises(ConfigError, match="--quantization fp8 does not quantize mixture-of-exp"):
        LLM(str(directory), quantization="fp8")
