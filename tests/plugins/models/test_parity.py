"""Greedy outputs identical to ``transformers`` token for token, and top logprobs within
1e-4, in float32, for every architecture pagedllm claims, with prefix caching on and
off, chunked prefill with a small budget, and a KV cache small enough to preempt."""

from __future__ import annotations

import pytest
import torch
from engine_settings import SETTINGS
from tiny_models import ARCHITECTURES, load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 24
NUM_LOGPROBS = 5


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(6, 512, (n,), generator=generator).tolist()

    shared = rand(33)
    # Different lengths; two share a 33-token prefix (prefix-cache hits while live).
    return [rand(3), shared + rand(5), rand(17), shared + rand(12), rand(48), rand(9)]


PROMPTS = _prompts()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def reference(request, tmp_path_factory):
    name = request.param
    directory = make_checkpoint(tmp_path_factory.mktemp(name), name)
    model = load_reference(directory)
    expected = [reference_greedy(model, p, NEW_TOKENS, NUM_LOGPROBS) for p in PROMPTS]
    return name, directory, expected


def _check(outputs, expected) -> None:
    for prompt_index, (output, (tokens, top)) in enumerate(zip(outputs, expected, strict=True)):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt {prompt_index}"
        assert len(completion.logprobs) == NEW_TOKENS
        for step, (ours, theirs) in enumerate(zip(completion.logprobs, top, strict=True)):
            for token_id, logprob in theirs.items():
                assert token_id in ours, f"prompt {prompt_index} step {step}: {token_id} missing"
                assert abs(ours[token_id].logprob - logprob) < 1e-4, (prompt_index, step)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_parity(reference, setting):
    _name, directory, expected = reference
    check_greedy_parity(directory, setting, expected)


def check_greedy_parity(directory, setting: str, expected, **extra) -> LLM:
    """An ``LLM`` of ``directory`` under ``setting`` keeps ``expected`` (transformers'
    tokens and top logprobs for PROMPTS), a second pass included with prefix caching;
    every block comes back. Returns the LLM."""
    kwargs = {**SETTINGS[setting], **extra}
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True, **kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=NUM_LOGPROBS
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    _check(llm.generate(prompts, params, use_tqdm=False), expected)
    engine = llm.llm_engine
    if setting == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if setting == "prefix_caching":
        # A second pass finds the prompts in the cache and still matches.
        again = llm.generate(prompts, params, use_tqdm=False)
        _check(again, expected)
        assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
        assert engine.kv_manager.total_prefix_cache_stats.hits > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return llm


def test_llama_family_members_differ_by_class_attributes():
    """Qwen2's biases and Qwen3's q/k norms come from the class registered for the
    architecture, not from the config's model_type; Q/K/V and gate/up are built fused."""
    import transformers

    from pagedllm.core.layers.linear import FusedLinear
    from pagedllm.plugins.models.llama import (
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )

    # One config (model_type "llama") for all three.
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    expected = {  # (q/k/v bias, o bias, q/k norm)
        LlamaForCausalLM: (False, False, False),
        Qwen2ForCausalLM: (True, False, False),
        Qwen3ForCausalLM: (False, False, True),
    }
    for cls, (qkv_bias, o_bias, qk_norm) in expected.items():
        layer = cls(config).model.layers[0]
        attn = layer.self_attn
        assert (attn.q_proj.bias is not None, attn.v_proj.bias is not None) == (qkv_bias,) * 2
        assert (attn.o_proj.bias is not None) == o_bias, cls
        assert (attn.q_norm is not None) == qk_norm, cls
        assert [type(run) for run in attn.qkv.runs] == [FusedLinear]
        assert [type(run) for run in layer.mlp.gate_up.runs] == [FusedLinear]


@pytest.mark.parametrize("name", ["silu", "swish", "relu", "gelu", "gelu_pytorch_tanh"])
def test_activation_table_computes_what_transformers_does(name):
    """pagedllm's own activation table (no transformers import at start-up) gives
    bit-identical values to transformers' ACT2FN."""
    from transformers.activations import ACT2FN

    from pagedllm.plugins.models.common import activation

    x = torch.randn(4, 257, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(activation(name)(x), ACT2FN[name](x))
