"""The native decoder layer (pagedllm/kernels/cpu_layer.py) with dense float32 / bfloat16
weights (a safetensors checkpoint): decode steps of up to the small-row kernel's rows run
as one native call per layer, bit-identical to the op-by-op module path, in
batch-invariant mode too (Qwen2's Q/K/V biases, Qwen3's norms of each head, Phi-3's fused
checkpoint weights, Gemma 3's layers and Gemma 2's soft-capped scores included); layers it
cannot compute (an output projection's bias) keep the module path."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    assert_native_layers_match,
    assert_same_outputs,
    generate_with_first_alone,
    make_checkpoint,
    randomize_weights,
)

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.batch_invariant import unavailable_reason
from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.kernels.dense_amx import AMX_ROWS, amx_kernels
from pagedllm.kernels.dense_cpu import SMALL_ROWS_MAX, dense_kernels, small_rows_max
from pagedllm.kernels.gguf_cpu import cpu_kernels

pytestmark = pytest.mark.skipif(
    dense_kernels() is None or cpu_ops() is None, reason="no compiled CPU kernels"
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # (heads of 32: the bfloat16 attention cache's kernel path)
    return make_checkpoint(
        tmp_path_factory.mktemp("llama"),
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _skip_unless_supported(dtype: str, invariant: bool) -> None:
    if invariant and unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    if dtype == "bfloat16" and not cpu_ops().bf16_cache_ok(32):
        pytest.skip("no bfloat16 attention cache kernel on this CPU")
    if invariant and dtype == "bfloat16" and not cpu_kernels().bf16:
        # (the panels then widen the rows to float32, which the native layer does not: it
        # declines those steps, test_native_layer_declines_widened_panels)
        pytest.skip("no bfloat16 panels (AVX512-BF16) on this CPU")


def _llm(checkpoint, dtype: str, invariant: bool = False) -> LLM:
    return LLM(
        str(checkpoint),
        dtype=dtype,
        disable_log_stats=True,
        enable_prefix_caching=False,
        batch_invariant=invariant,
    )


# Six short prompts, greedy with logprobs: decode steps of up to six rows.
_SHORT_PROMPTS = [{"prompt_token_ids": [7 + i, 300 + i, 9, 11 + 2 * i]} for i in range(6)]
_PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=3)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_native_layers_match_the_module_path(llama, dtype, invariant):
    _skip_unless_supported(dtype, invariant)
    llm = _llm(llama, dtype, invariant)
    layers = llm.llm_engine.runner.model.model.layers
    limit = small_rows_max(layers[0].input_layernorm.weight.dtype)
    if dtype == "bfloat16" and _amx():
        # (the AMX kernel's rows too; its test below runs steps of those)
        limit = AMX_ROWS[-1]
    prompts = [{"prompt_token_ids": list(range(100, 140))}, {"prompt_token_ids": [5, 6, 7]}]
    # More prompts than the layer takes rows: those decode steps stay op by op.
    prompts += [{"prompt_token_ids": [7 + i, 300 + i, 9]} for i in range(limit + 2)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=3)
    native = generate_with_first_alone(llm, prompts, params)
    assert all(layer._native for layer in layers)
    # (the steps of one row at least: 7 decode steps of the prompt alone)
    assert all(layer._native.steps >= 7 for layer in layers)
    assert layers[0]._native.max_tokens() == limit
    for layer in layers:
        layer._native = False
    assert_same_outputs(native, generate_with_first_alone(llm, prompts, params))


def _amx() -> bool:
    return amx_kernels() is not None and amx_kernels().available


@pytest.mark.skipif(not _amx(), reason="no AMX on this CPU")
@pytest.mark.parametrize("rows", [AMX_ROWS.start + 1, SMALL_ROWS_MAX[torch.bfloat16] + 12])
def test_bfloat16_batched_decodes_run_natively_on_amx(llama, rows):
    """Decode steps of more rows than the small-row kernel takes (the AMX kernel's, in the
    modules and in the layer alike): one native call per layer, the same bits."""
    if not cpu_ops().bf16_cache_ok(32):
        pytest.skip("no bfloat16 attention cache kernel on this CPU")
    llm = LLM(str(llama), dtype="bfloat16", disable_log_stats=True, enable_prefix_caching=False)
    layers = llm.llm_engine.runner.model.model.layers
    prompts = [{"prompt_token_ids": [7 + i, 300 + i, 9, 11 + 2 * i]} for i in range(rows)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
    native = llm.generate(prompts, params, use_tqdm=False)
    assert all(layer._native.steps >= 5 for layer in layers)
    for layer in layers:
        layer._native = False
    assert_same_outputs(native, llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen2_layers_add_their_qkv_bias_natively(tmp_path, dtype):
    """Qwen2's Q/K/V products have a bias (its output projection none): the native layer
    adds it as the modules do (rounded to bfloat16 first in a bfloat16 model), and its
    decode steps give the module path's bits."""
    if dtype == "bfloat16" and not cpu_ops().bf16_cache_ok(32):
        pytest.skip("no bfloat16 attention cache kernel on this CPU")
    checkpoint = make_checkpoint(
        tmp_path, "qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4
    )
    randomize_weights(checkpoint, ("_proj.bias",), seed=5, base=0.0)
    llm = LLM(str(checkpoint), dtype=dtype, disable_log_stats=True, enable_prefix_caching=False)
    assert llm.llm_engine.runner.model.model.layers[0].self_attn.qkv.runs[0].bias is not None
    assert_native_layers_match(llm, _SHORT_PROMPTS, _PARAMS)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_layers_norm_each_head_natively(tmp_path, dtype, invariant):
    """Qwen3 norms each query and key head (RMSNorm over head_dim) before the rotary
    embedding: the native layer norms them with the modules' kernel, and its decode steps
    give the module path's bits, one row or several, in batch-invariant mode too."""
    _skip_unless_supported(dtype, invariant)
    checkpoint = make_checkpoint(
        tmp_path,
        "qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    # (random norms, apart for Q and K: a norm given the other's weight, or none, shows)
    randomize_weights(checkpoint, ("q_norm.weight", "k_norm.weight"), seed=3, base=1.0)
    llm = _llm(checkpoint, dtype, invariant)
    assert llm.llm_engine.runner.model.model.layers[0].self_attn.has_qk_norm
    assert_native_layers_match(llm, _SHORT_PROMPTS, _PARAMS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phi3_fused_checkpoint_layers_run_natively(tmp_path, dtype):
    """Phi-3's checkpoints fuse Q/K/V and gate/up in one weight each (a layer, not a
    group of them), rotate half of each head (partial_rotary_factor 0.5) and slide a
    window: its decode steps run as one native call per layer (the MLP's SiLU on the
    modules' kernel, as Llama's), bit-identical to the module path."""
    if dtype == "bfloat16" and not cpu_ops().bf16_cache_ok(32):
        pytest.skip("no bfloat16 attention cache kernel on this CPU")
    checkpoint = make_checkpoint(
        tmp_path, "phi3", hidden_size=128, intermediate_size=256, num_attention_heads=4
    )
    llm = _llm(checkpoint, dtype)
    assert llm.llm_engine.runner.model.model.rotary_emb.rotary_dim == 16
    # (past the window of 20: the layers' attention slides)
    prompts = [{"prompt_token_ids": list(range(100, 130))}, *_SHORT_PROMPTS[:5]]
    assert_native_layers_match(llm, prompts, _PARAMS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_layers_run_natively(tmp_path, dtype):
    """Gemma 3's layers: four norms scaling by (1 + w), the attention's and the MLP's
    outputs normed before their residual adds, norms of each query and key head, GELU's
    tanh form, a query scale of its own, sliding and global layers with their own RoPE
    tables: one native call per layer and decode step, the module path's bits. (Gemma 3
    has no batch-invariant mode.)"""
    _skip_unless_supported(dtype, False)
    checkpoint = make_checkpoint(
        tmp_path,
        "gemma3",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
    )
    # (each norm its own random weights: one given another's, or dropped, shows)
    norms = ("layernorm.weight", "q_norm.weight", "k_norm.weight")
    randomize_weights(checkpoint, norms, seed=5, base=0.0)
    llm = _llm(checkpoint, dtype)
    layers = llm.llm_engine.runner.model.model.layers
    assert {layer.layer_type for layer in layers} == {"sliding_attention", "full_attention"}
    # (past the window of 12: the sliding layers' attention slides)
    prompts = [{"prompt_token_ids": list(range(100, 120))}, *_SHORT_PROMPTS[:5]]
    assert_native_layers_match(llm, prompts, _PARAMS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma2_layers_soft_cap_natively(tmp_path, dtype):
    """Gemma 2's layers (Gemma 3's without norms of each head, with soft-capped attention
    scores: the paged-attention kernel's cap) run natively, the module path's bits."""
    _skip_unless_supported(dtype, False)
    checkpoint = make_checkpoint(
        tmp_path,
        "gemma2",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    randomize_weights(checkpoint, ("layernorm.weight",), seed=6, base=0.0)
    llm = _llm(checkpoint, dtype)
    layers = llm.llm_engine.runner.model.model.layers
    assert all(layer.self_attn.attn.logits_soft_cap == 1.0 for layer in layers)
    prompts = [{"prompt_token_ids": list(range(100, 120))}, *_SHORT_PROMPTS[:5]]
    assert_native_layers_match(llm, prompts, _PARAMS)


def test_layers_with_biases_keep_the_module_path(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "llama", attention_bias=True)
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    # (False: inspected at the first step, and declined)
    assert all(layer._native is False for layer in llm.llm_engine.runner.model.model.layers)


def test_native_layer_declines_widened_panels(llama):
    """Batch-invariant bfloat16 without AVX512-BF16: the modules' panels widen the rows to
    float32, which the native layer does not, so it takes none of those steps, and the
    tokens are the module path's."""
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    if cpu_kernels().bf16 or not cpu_ops().bf16_cache_ok(32):
        pytest.skip("bfloat16 panels on this CPU (or no bfloat16 attention cache kernel)")
    llm = LLM(
        str(llama),
        dtype="bfloat16",
        disable_log_stats=True,
        enable_prefix_caching=False,
        batch_invariant=True,
    )
    layers = llm.llm_engine.runner.model.model.layers
    prompts = [{"prompt_token_ids": [7 + i, 300 + i, 9]} for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
    native = generate_with_first_alone(llm, prompts, params)
    assert all(layer._native and layer._native.steps == 0 for layer in layers)
    for layer in layers:
        layer._native = False
    assert_same_outputs(native, generate_with_first_alone(llm, prompts, params))
