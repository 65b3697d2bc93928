"""The cuda device's Triton kernels (paged attention, KV-cache writes, RMSNorm, RoPE,
SiLU·mul), run on CPU by Triton's interpreter against their torch references."""

from __future__ import annotations

import math
import os

# Before triton is imported anywhere: run kernels with the numpy interpreter (no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_cpu_ops import (
    BLOCK_SIZE,
    LONG,
    SEQUENCES,
    _batch,
    _kernel_inputs,
    _Layer,
    _metadata_args,
    _reference_attention,
)
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.attention.torch_backend import TorchSDPABackend
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.attention import write_kv_cache
from pagedllm.kernels.norms import rms_norm
from pagedllm.kernels.rotary import apply_rotary
from pagedllm.kernels.triton_attention import (
    ATTENTION_BLOCK_N,
    triton_available,
    triton_paged_attention,
    triton_rms_norm,
    triton_rotary_neox_,
    triton_silu_mul,
    triton_write_kv_cache,
)
from pagedllm.plugins.devices.cuda_attention import TritonMetadata, TritonPagedBackend


def test_available():
    assert triton_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_cache_write_is_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, BLOCK_SIZE, 3, 16, generator=g).to(dtype)
    key, value = torch.randn(2, 5, 3 * 16, generator=g)
    slots = torch.tensor([17, 3, 90, 40, 41])
    expected = cache.clone()
    write_kv_cache(key.view(5, 3, 16), value.view(5, 3, 16), expected, slots)
    triton_write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


# (heads, KV heads, head size): grouped queries, one KV head, a head size that is not a
# power of two (its lanes are masked).
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 32), (4, 2, 80)], ids=str)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_the_reference(shape, window):
    """Decodes, a chunk over cached context, a whole prompt and a long context (several
    key blocks of the kernel): the float64 reference within float32 rounding."""
    heads, kv_heads, d = shape
    cache, q, k, v = _batch(SEQUENCES, heads=heads, kv_heads=kv_heads, d=d)
    expected, expected_cache = _reference_attention(cache, q, k, v, SEQUENCES, window)
    slots, ranges, tables = _kernel_inputs(SEQUENCES)
    assert max(s[1] for s in SEQUENCES) > 2 * ATTENTION_BLOCK_N
    triton_write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache.view(2, -1, kv_heads, d), expected_cache)
    out = torch.full_like(q, math.nan)
    triton_paged_attention(q, cache, ranges, tables, heads, kv_heads, d, d**-0.5, window, out=out)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_soft_capping_and_a_bfloat16_cache():
    """Soft-capped scores (Gemma 2) over a bfloat16 cache with bfloat16 queries: the
    reference on the same values, capped, within bfloat16 output rounding."""
    heads, kv_heads, d, cap = 4, 2, 32, 5.0
    cache, q, k, v = _batch(SEQUENCES, heads=heads, kv_heads=kv_heads, d=d, seed=3)
    cache, q, k, v = (x.bfloat16() for x in (cache, q * 4, k, v))
    slots, ranges, tables = _kernel_inputs(SEQUENCES)
    triton_write_kv_cache(k, v, cache, slots)
    out = triton_paged_attention(q, cache, ranges, tables, heads, kv_heads, d, 1.0, softcap=cap)
    assert out.dtype == torch.bfloat16
    flat = cache.float().view(2, -1, kv_heads, d)
    offset = 0
    for query_len, context_len, blocks in SEQUENCES:
        ctx = torch.tensor(
            [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len)]
        )
        keys = flat[0, ctx].repeat_interleave(heads // kv_heads, dim=1)
        values = flat[1, ctx].repeat_interleave(heads // kv_heads, dim=1)
        for t in range(query_len):
            p = context_len - query_len + t
            qt = q[offset + t].float().view(heads, d)
            scores = torch.einsum("hd,khd->hk", qt, keys[: p + 1])
            scores = cap * torch.tanh(scores / cap)
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), values[: p + 1]).reshape(-1)
            got = out[offset + t].float()
            assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), (p, (got - want).abs().max())
        offset += query_len


def test_paged_attention_leaves_tokens_of_unlisted_sequences():
    cache, q, k, v = _batch(SEQUENCES, heads=4, kv_heads=2, d=16)
    slots, ranges, tables = _kernel_inputs(SEQUENCES)
    triton_write_kv_cache(k, v, cache, slots)
    whole = triton_paged_attention(q, cache, ranges, tables, 4, 2, 16, 0.25)
    # Only the second sequence listed: its rows computed alike, the others untouched.
    first = SEQUENCES[0][0]
    out = torch.full_like(q, 7.0)
    part = triton_paged_attention(q, cache, ranges[:, 1:2], tables[1:2], 4, 2, 16, 0.25, out=out)
    rows = slice(first, first + SEQUENCES[1][0])
    assert torch.equal(part[rows], whole[rows])
    assert (part[:first] == 7.0).all() and (part[rows.stop :] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_reference(dtype, offset):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    residual = torch.randn(7, 96, generator=g).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = triton_rms_norm(x, weight, 1e-6, offset)
    want = rms_norm(x, weight, 1e-6, offset)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    total, normed = triton_rms_norm(x, weight, 1e-6, offset, residual=residual)
    assert torch.equal(total, residual + x)
    want = rms_norm(residual + x, weight, 1e-6, offset)
    assert torch.allclose(normed.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_is_bit_exact(dtype, rotary_dim):
    """Full and partial rotary dims, on views of one fused QKV buffer: the reference's
    float32 products rounded once."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=g).to(dtype)
    query = qkv[:, : 4 * 64].view(5, 4, 64)
    key = qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    positions = torch.tensor([0, 3, 9, 100, 4])
    angles = torch.randn(128, rotary_dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q = apply_rotary(query.float(), cos[positions], sin[positions], rotary_dim).to(dtype)
    want_k = apply_rotary(key.float(), cos[positions], sin[positions], rotary_dim).to(dtype)
    value = qkv[:, 6 * 64 :].clone()
    triton_rotary_neox_(query, key, positions, cos, sin, rotary_dim)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)
    assert torch.equal(qkv[:, 6 * 64 :], value)  # (the values untouched)


def test_rotary_takes_a_single_kv_head_of_any_stride():
    """Multi-query attention (Falcon): the one key head is a view whose head stride is
    not the head size (a [T, 1, d] slice of the fused projection viewed per head)."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 6 * 32, generator=g)
    query = qkv[:, : 4 * 32].view(3, 4, 32)
    key = qkv.view(3, 6, 32)[:, 4:5]
    assert key.stride(1) == 32 and qkv.view(3, 1, -1)[:, :, 4 * 32 : 5 * 32].stride(1) != 32
    key = qkv.view(3, 1, -1)[:, :, 4 * 32 : 5 * 32]
    positions = torch.tensor([1, 7, 2])
    angles = torch.randn(16, 16, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_k = apply_rotary(key.clone(), cos[positions], sin[positions])
    triton_rotary_neox_(query, key, positions, cos, sin, 32)
    assert torch.equal(key, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(6, 2 * 300, generator=g) * 4).to(dtype)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    got = triton_silu_mul(gate, up, block=128)  # (several column blocks, the last partial)
    want = F.silu(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 24])
def test_backend_matches_the_reference_backend(window):
    """The cuda device's backend on one step of decodes, chunks over cached context and
    long prefills (with and without cached context), all in one kernel call: the
    reference backend's cache and outputs."""
    sequences = SEQUENCES + LONG
    cache, q, k, v = _batch(sequences, seed=5)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    cpu = torch.device("cpu")
    ours = TritonPagedBackend().build_metadata(*_metadata_args(sequences), [ours_cache], cpu)
    reference = TorchSDPABackend().build_metadata(*_metadata_args(sequences), [ref_cache], cpu)
    assert isinstance(ours, TritonMetadata) and ours.backend is not None
    got = ours.backend.forward(_Layer(window), q, k, v, ours)
    expected = reference.backend.forward(_Layer(window), q, k, v, reference)
    assert torch.equal(ours_cache, ref_cache)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ["llama", "mistral", "gemma2"])
def test_a_model_on_the_triton_backend_keeps_greedy_parity(architecture, tmp_path, monkeypatch):
    """PAGEDLLM_ATTENTION_BACKEND=triton_paged on the cpu device (interpreted kernels):
    transformers' greedy tokens, with prefix caching and prompts chunked over their cached
    part (Mistral: a sliding window shorter than the prompts; Gemma 2: soft-capped
    attention scores too)."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton_paged")
    directory = make_checkpoint(tmp_path / architecture, architecture)
    reference = load_reference(directory)
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(6, 512, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(6, 512, (n,), generator=g).tolist() for n in (3, 9)]
    llm = LLM(
        str(directory),
        dtype="float32",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        disable_log_stats=True,
    )
    assert isinstance(llm.llm_engine.runner.attention_backend, TritonPagedBackend)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    for _ in range(2):  # the second pass hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 6)[0]
    assert llm.llm_engine.kv_manager.total_prefix_cache_stats.hits > 0


def test_an_unknown_attention_backend_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "flash_magic")
    directory = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="PAGEDLLM_ATTENTION_BACKEND='flash_magic'.*triton_paged"):
        LLM(str(directory), dtype="float32")


def test_the_triton_backend_is_refused_on_cpu_tensors_without_the_interpreter(monkeypatch):
    """Without a GPU, Triton compiles for nothing: the backend says so at start-up rather
    than failing every request."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the backend compiles for it")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        TritonPagedBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(TritonPagedBackend(), TritonPagedBackend)
