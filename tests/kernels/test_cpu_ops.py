"""The compiled CPU kernels of ``csrc/cpu_ops.c`` against their torch references, and the
cpu device's paged-attention backend against the reference backend."""

from __future__ import annotations

import math
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import skip_unless_build_failed

from pagedllm.core.attention.metadata import AttentionMetadata
from pagedllm.core.attention.torch_backend import TorchSDPABackend
from pagedllm.kernels.cpu_ops import GATED_KERNELS
from pagedllm.kernels.native import CSRC, c_compiler, load_kernel_library
from pagedllm.kernels.norms import rms_norm
from pagedllm.kernels.rotary import apply_rotary
from pagedllm.plugins.devices import cpu_attention
from pagedllm.plugins.devices.cpu_attention import CpuPagedBackend, PagedMetadata


@pytest.fixture(scope="module")
def ops():
    from pagedllm.kernels.cpu_ops import cpu_ops

    loaded = cpu_ops()
    if loaded is None:
        skip_unless_build_failed()
    return loaded


def test_rms_norm_matches_reference(ops):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=g) * 3
    w = torch.randn(576, generator=g)
    for eps, offset in [(1e-5, 0.0), (1e-6, 1.0)]:
        expected = rms_norm(x, w, eps, offset)
        got = ops.rms_norm(x, w, eps, offset)
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got, x)
    # Rows of a wider buffer (a view with a row stride), and 3-D contiguous input.
    wide = torch.randn(4, 600, generator=g)
    assert ops.rows_ok(wide[:, :576])
    assert torch.allclose(ops.rms_norm(wide[:, :576], w, 1e-5), rms_norm(wide[:, :576], w, 1e-5))
    heads = torch.randn(3, 4, 64, generator=g)
    w64 = torch.randn(64, generator=g)
    assert torch.allclose(ops.rms_norm(heads, w64, 1e-6), rms_norm(heads, w64, 1e-6), atol=1e-6)
    assert not ops.rows_ok(heads.transpose(0, 1)) and not ops.rows_ok(x.double())


def test_add_rms_norm_returns_the_exact_sum(ops):
    g = torch.Generator().manual_seed(1)
    x, residual, w = (
        torch.randn(6, 128, generator=g),
        torch.randn(6, 128, generator=g),
        torch.randn(128, generator=g),
    )
    before = residual.clone()
    total, normed = ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(total, before + x)
    assert torch.equal(residual, before)  # the input is not written
    assert torch.allclose(normed, rms_norm(before + x, w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_is_bit_exact_on_views_of_a_fused_buffer(ops, rotary_dim):
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, d = 7, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    angles = torch.randn(200, rotary_dim, generator=g)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 5, 9, 199, 3, 2, 1])
    expected_q = apply_rotary(q, cos[positions], sin[positions], rotary_dim)
    expected_k = apply_rotary(k, cos[positions], sin[positions], rotary_dim)
    ops.rotary_neox_(q, k, positions, cos, sin, rotary_dim)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form as x * sigmoid(2u) in float64, rounded to ``x``'s dtype: the
    function torch computes as 0.5 x (1 + tanh(u)), whose 1 + tanh(u) cancels to zero
    (even in float64) where x * sigmoid(2u) is still exact, below x = -5 or so."""
    x64 = x.double()
    u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
    return (x64 * torch.sigmoid(2 * u)).to(x.dtype)


# The gated kernels (cpu_ops.GATED_KERNELS) and the activation each computes.
_GATED = {"silu_mul": F.silu, "gelu_tanh_mul": _gelu_tanh}


def test_gated_kernels_are_the_tested_ones():
    assert set(_GATED) == set(GATED_KERNELS)
    x = torch.linspace(-12, 12, 4801)
    torch.testing.assert_close(_gelu_tanh(x), F.gelu(x, approximate="tanh"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel", sorted(_GATED))
def test_gated_kernels_match_reference(ops, kernel):
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 1536, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split([1536, 1536], dim=-1)
    expected = _GATED[kernel](gate) * up
    got = ops.gated_mul(kernel, gate, up)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # (each row's result its own)
    assert torch.equal(ops.gated_mul(kernel, gate[2:3], up[2:3]), got[2:3])


@pytest.mark.parametrize("kernel", sorted(_GATED))
def test_gated_kernel_lanes_equal_the_plain_loop(ops, kernel):
    """A float32 gated kernel's vector lanes (where the build has them) compute what its
    plain loop computes, bit for bit: each column once among 1536 (eight lanes at a time)
    and once as the first of 7 columns (fewer than eight: the loop)."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(3, 2 * 1536, generator=g) * 8
    special = [-100.0, 100.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), 88.0, -87.0]
    gate_up[0, : len(special)] = torch.tensor(special)
    gate, up = gate_up.split([1536, 1536], dim=-1)
    lanes = ops.gated_mul(kernel, gate, up)
    loop = torch.stack(
        [
            ops.gated_mul(kernel, gate[:, j : j + 7], up[:, j : j + 7])[:, 0]
            for j in range(1536 - 7)
        ],
        1,
    )
    assert torch.equal(lanes[:, : 1536 - 7].isnan(), loop.isnan())
    assert torch.equal(lanes[:, : 1536 - 7].nan_to_num(0.5), loop.nan_to_num(0.5))
    finite = gate.isfinite()
    expected = (_GATED[kernel](gate) * up)[finite]
    torch.testing.assert_close(lanes[finite], expected, rtol=1e-6, atol=1e-6)


def _bf16_mismatch(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Share of elements that differ, each by at most one bfloat16 step."""
    assert got.dtype == expected.dtype == torch.bfloat16
    diff = (got.float() - expected.float()).abs()
    step = expected.float().abs() * 2**-7 + 1e-30
    assert bool((diff <= step).all()), float((diff / step).max())
    return float((diff > 0).float().mean())


def test_bfloat16_elementwise_kernels_round_like_the_reference(ops):
    """bfloat16 rows: the kernels compute in float32 and round where torch's bfloat16 ops
    round. RoPE is bit-exact; RMSNorm (its RMS summed in another order) and SiLU (another
    exp) may differ from torch by one bfloat16 step in a few elements."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(33, 576, generator=g) * 3).bfloat16()
    residual = torch.randn(33, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    for offset in (0.0, 1.0):
        got = ops.rms_norm(x, w, 1e-5, offset)
        assert got.dtype == torch.bfloat16
        assert _bf16_mismatch(got, rms_norm(x, w, 1e-5, offset)) < 0.01
    total, normed = ops.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(total, residual + x)
    assert _bf16_mismatch(normed, rms_norm(residual + x, w, 1e-6)) < 0.01
    with pytest.raises(TypeError, match="one dtype"):
        ops.rms_norm(x, w.float(), 1e-5)

    gate_up = (torch.randn(70, 2 * 1536, generator=g) * 6).bfloat16()
    gate, up = gate_up.split([1536, 1536], dim=-1)
    for kernel, act in _GATED.items():
        got = ops.gated_mul(kernel, gate, up)
        assert got.dtype == torch.bfloat16
        assert _bf16_mismatch(got, act(gate) * up) < 0.01

    tokens, heads, kv_heads, d = 7, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    angles = torch.randn(200, d, generator=g)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 5, 9, 199, 3, 2, 1])
    c, s_ = cos[positions].bfloat16(), sin[positions].bfloat16()
    expected_q, expected_k = apply_rotary(q, c, s_), apply_rotary(k, c, s_)
    ops.rotary_neox_(q, k, positions, cos, sin, d)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


# (query_len, context_len, blocks): decodes, a prefill chunk after cached context, a whole
# short prompt, and (for the backend) prompts past the kernel's query limit.
# The last two contexts span several of the kernel's 64-key chunks (online softmax): a
# prefill chunk's and a decode token's (which the AVX2 build reads rows at a time).
SEQUENCES = [
    (1, 37, [5, 9, 2]),
    (4, 20, [7, 1]),
    (1, 1, [3]),
    (9, 9, [11]),
    (2, 150, [30, 27, 28, 29, 31, 32, 39, 34, 35, 36]),
    (1, 150, [12, 13, 14, 15, 16, 17, 18, 19, 33, 37]),
]
LONG = [(40, 40, [20, 21, 22]), (20, 50, [23, 24, 25, 26])]
NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, D = 40, 16, 9, 3, 64


def _batch(sequences, seed=4, heads=HEADS, kv_heads=KV_HEADS, d=D):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d, generator=g)
    tokens = sum(s[0] for s in sequences)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return cache, q, k, v


# The kernel's online softmax takes keys in chunks of this many (cpu_ops.c, CHUNK).
KERNEL_CHUNK = 64


def _online_bf16_weights(scores, values):
    """Softmax-weighted values, chunk by chunk as the kernel goes: each chunk's
    probabilities relative to the running maximum, rounded to bfloat16 to weight the
    values; the running sums rescaled as the maximum grows."""
    heads = scores.shape[0]
    m = torch.full((heads, 1), -math.inf, dtype=torch.float64)
    total = torch.zeros(heads, 1, dtype=torch.float64)
    acc = torch.zeros(heads, values.shape[-1], dtype=torch.float64)
    first = int((scores[0] > -math.inf).nonzero()[0])  # (the window's first key)
    for j0 in range(first, scores.shape[1], KERNEL_CHUNK):
        chunk = scores[:, j0 : j0 + KERNEL_CHUNK]
        new_m = torch.maximum(m, chunk.max(-1, keepdim=True).values)
        keep = (m - new_m).exp()
        e = (chunk - new_m).exp()
        acc = acc * keep + torch.einsum(
            "hk,khd->hd", e.bfloat16().double(), values[j0 : j0 + KERNEL_CHUNK]
        )
        total = total * keep + e.sum(-1, keepdim=True)
        m = new_m
    return acc / total


def _reference_attention(cache, q, k, v, sequences, window, bf16_products=False, soft_cap=None):
    """Float64 softmax attention over each request's context, read slot by slot.
    ``bf16_products``: the rounding of torch's bfloat16 attention (and of the kernel's
    bfloat16 dot-product path): queries rounded to bfloat16, and the softmax's unnormalised
    probabilities rounded to bfloat16 where they weight the values (not in their sum).
    ``soft_cap``: scaled scores become ``soft_cap * tanh(score / soft_cap)``."""
    kv_heads, d = cache.shape[-2:]
    if bf16_products:
        q = q.bfloat16()
    heads = q.shape[-1] // d
    flat = cache.double().clone().view(2, -1, kv_heads, d)
    out = torch.empty(q.shape[0], heads * d, dtype=torch.float64)
    offset = 0
    for query_len, context_len, blocks in sequences:
        slots = torch.tensor(
            [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len)]
        )
        new = slots[context_len - query_len :]
        flat[0, new] = k[offset : offset + query_len].double().view(-1, kv_heads, d)
        flat[1, new] = v[offset : offset + query_len].double().view(-1, kv_heads, d)
        keys = flat[0, slots].repeat_interleave(heads // kv_heads, dim=1)
        values = flat[1, slots].repeat_interleave(heads // kv_heads, dim=1)
        for t in range(query_len):
            p = context_len - query_len + t
            scores = (
                torch.einsum("hd,khd->hk", q[offset + t].double().view(heads, d), keys) * d**-0.5
            )
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            seen = torch.arange(context_len) <= p
            if window:
                seen &= p - torch.arange(context_len) < window
            scores[:, ~seen] = -math.inf
            if bf16_products:
                out[offset + t] = _online_bf16_weights(scores, values).reshape(-1)
            else:
                out[offset + t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1)
        offset += query_len
    return out.float(), flat.float()


# (heads, KV heads, head size): every register tile shape of the AVX-512 path (4, 3, 2
# and 1 heads of 64; 2 and 1 of 128; 256; up to 4 of 32 and 16), a head size it does not
# take (80: the generic loop, in the AVX2 tiles) and one the AVX2 tiles do not (20: not a
# multiple of 8).
SHAPES = [
    (9, 3, 64), (7, 1, 64), (5, 1, 128), (4, 2, 256), (12, 2, 32), (6, 6, 16), (4, 2, 80),
    (6, 2, 20),
]  # fmt: skip


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_attention_matches_reference(ops, window, shape, cache_dtype):
    """float32 queries over a float32 cache, or a bfloat16 one (``--dtype bfloat16``: keys
    and values stored rounded as ``.to()`` rounds them, read back exactly; with bfloat16
    products on AVX512-BF16, against a reference that rounds as they do)."""
    _check_paged_attention(ops, window, shape, cache_dtype)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_avx2_build_reads_a_bfloat16_cache(window, shape):
    """The AVX2 build (-march=haswell), run here: its loop reads a bfloat16 cache, keys
    and values widened, and writes the new rows rounded, as the reference does."""
    ops = _march_ops()
    assert ops.bf16_cache_ok(64) and not ops.bf16_products(64)
    _check_paged_attention(ops, window, shape, torch.bfloat16)


def _check_paged_attention(ops, window, shape, cache_dtype) -> None:
    heads, kv_heads, d = shape
    cache, q, k, v = _batch(SEQUENCES, heads=heads, kv_heads=kv_heads, d=d)
    if cache_dtype == torch.bfloat16:
        if not ops.bf16_cache_ok(64):
            pytest.skip("this build reads no bfloat16 cache")
        # What the kernel sees and stores: the cache and the new rows in bfloat16.
        cache = cache.bfloat16()
        expected, expected_cache = _reference_attention(
            cache.float(),
            q,
            k.bfloat16().float(),
            v.bfloat16().float(),
            SEQUENCES,
            window,
            bf16_products=ops.bf16_products(d),
        )
        expected_cache = expected_cache.bfloat16()
    else:
        expected, expected_cache = _reference_attention(cache, q, k, v, SEQUENCES, window)
    slots, ranges, tables = _kernel_inputs(SEQUENCES)
    out = torch.full((q.shape[0], heads * d), math.nan)
    if cache_dtype == torch.bfloat16 and not ops.bf16_cache_ok(d):
        before = cache.clone()
        with pytest.raises(ValueError, match="bfloat16 cache"):
            ops.paged_attention(
                q, k, v, cache, slots, ranges, tables,
                heads, kv_heads, d, d**-0.5, window, out,
            )  # fmt: skip
        assert torch.equal(cache, before)  # refused before writing anything
        return
    ops.paged_attention(
        q,
        k,
        v,
        cache,
        slots,
        ranges,
        tables,
        heads,
        kv_heads,
        d,
        d**-0.5,
        window,
        out,
    )
    assert torch.equal(cache.view(2, -1, kv_heads, d), expected_cache)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)


def _kernel_inputs(sequences):
    """Slot mapping, sequence ranges and block tables of a step of ``sequences``."""
    slots, ranges, offset = [], [[], [], []], 0
    tables = torch.zeros(len(sequences), 10, dtype=torch.int32)
    for i, (query_len, context_len, blocks) in enumerate(sequences):
        slots += [
            blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(context_len - query_len, context_len)
        ]
        for row, value in zip(ranges, (offset, offset + query_len, context_len), strict=True):
            row.append(value)
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        offset += query_len
    return torch.tensor(slots), torch.tensor(ranges), tables


def _march_ops(march: str = "haswell"):
    """The CPU kernels built for another x86 target (-march=``march``), run here."""
    from pagedllm.kernels.cpu_ops import CpuOps

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    lib = load_kernel_library("cpu_ops", march=march)
    if lib is None:
        pytest.skip(f"no build for -march={march}")
    return CpuOps(lib)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", ["native", "haswell"])
def test_attention_is_the_same_however_the_work_is_split(ops, threads, cache_dtype, build):
    """The work items are whole query tokens (all KV heads; on AVX512-BF16 with a bfloat16
    cache, a thread fetching its next item's first keys; on AVX2, the keys taken a few
    rows at a time for all the heads) where there are tokens enough, else one KV head of a
    token: each sequence alone (a single decode token goes by heads) gives the very values
    of the whole batch, in this CPU's build and the AVX2 one."""
    if build == "haswell":
        ops = _march_ops()
    if cache_dtype == torch.bfloat16 and not ops.bf16_cache_ok(D):
        pytest.skip("this build reads no bfloat16 cache")
    cache, q, k, v = _batch(SEQUENCES, seed=6)
    cache = cache.to(cache_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = torch.full((q.shape[0], HEADS * D), math.nan)
        ops.paged_attention(
            q, k, v, cache.clone(), *_kernel_inputs(SEQUENCES), HEADS, KV_HEADS, D, D**-0.5,
            None, whole,
        )  # fmt: skip
        offset = 0
        for seq in SEQUENCES:
            rows = slice(offset, offset + seq[0])
            alone = torch.full((seq[0], HEADS * D), math.nan)
            ops.paged_attention(
                q[rows], k[rows], v[rows], cache.clone(), *_kernel_inputs([seq]), HEADS,
                KV_HEADS, D, D**-0.5, None, alone,
            )  # fmt: skip
            assert torch.equal(alone, whole[rows]), seq
            offset += seq[0]
    finally:
        torch.set_num_threads(before)


class _Layer:
    num_heads, num_kv_heads, head_dim, scale, layer_index = HEADS, KV_HEADS, D, D**-0.5, 0

    def __init__(self, window):
        self.sliding_window = window


def _metadata_args(sequences) -> tuple:
    """``build_metadata``'s query lengths, context lengths, block tables and block size."""
    return (
        [s[0] for s in sequences],
        [s[1] for s in sequences],
        [s[2] for s in sequences],
        BLOCK_SIZE,
    )


def _both_backends(sequences, cache, q, k, v, layer):
    """The paged backend's and the reference backend's outputs and caches for one step."""
    ours_cache, ref_cache = cache.clone(), cache.clone()
    cpu = torch.device("cpu")
    paged = CpuPagedBackend().build_metadata(*_metadata_args(sequences), [ours_cache], cpu)
    reference = TorchSDPABackend().build_metadata(*_metadata_args(sequences), [ref_cache], cpu)
    got = paged.backend.forward(layer, q, k, v, paged)
    expected = reference.backend.forward(layer, q, k, v, reference)
    return paged, got, expected, ours_cache, ref_cache


@pytest.mark.parametrize("kernel_max_query", [16, cpu_attention.KERNEL_MAX_QUERY])
@pytest.mark.parametrize("window", [None, 24])
def test_backend_matches_the_reference_backend(ops, window, kernel_max_query, monkeypatch):
    """Decodes and chunks of up to KERNEL_MAX_QUERY tokens in the kernel, longer prefills
    (with and without cached context) through SDPA: the same outputs and caches as the
    reference backend."""
    monkeypatch.setattr(cpu_attention, "KERNEL_MAX_QUERY", kernel_max_query)
    sequences = SEQUENCES + LONG
    cache, q, k, v = _batch(sequences, seed=5)
    paged, got, expected, ours_cache, ref_cache = _both_backends(
        sequences, cache, q, k, v, _Layer(window)
    )
    long = [s for s in sequences if s[0] > kernel_max_query]
    assert isinstance(paged, PagedMetadata) and len(paged.prefills) == len(long)
    assert len(long) == (len(LONG) if kernel_max_query == 16 else 0)
    assert torch.equal(ours_cache, ref_cache)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    truth, _ = _reference_attention(cache, q, k, v, sequences, window)
    assert torch.allclose(got, truth, rtol=1e-5, atol=1e-5)


def test_backend_falls_back_without_the_kernel(monkeypatch):
    cache, q, k, v = _batch(SEQUENCES)
    args = _metadata_args(SEQUENCES)
    monkeypatch.setattr(cpu_attention, "cpu_ops", lambda: None)
    metadata = CpuPagedBackend().build_metadata(*args, [cache], torch.device("cpu"))
    assert isinstance(metadata, AttentionMetadata)
    expected, _ = _reference_attention(cache, q, k, v, SEQUENCES, None)
    got = metadata.backend.forward(_Layer(None), q, k, v, metadata)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    # A float16 cache takes the reference path too (bfloat16: below).
    monkeypatch.undo()
    half = CpuPagedBackend().build_metadata(*args, [cache.half()], torch.device("cpu"))
    assert isinstance(half, AttentionMetadata)


def test_backend_bfloat16_model(ops):
    """A bfloat16 model: its bfloat16 cache read by the kernel on AVX-512 (float32 inside),
    else the reference path; either way the reference backend's cache, bit for bit, and
    its outputs within bfloat16 rounding."""
    sequences = SEQUENCES + LONG
    cache, q, k, v = _batch(sequences, seed=8)
    cache, q, k, v = cache.bfloat16(), q.bfloat16(), k.bfloat16(), v.bfloat16()
    paged, got, expected, ours_cache, ref_cache = _both_backends(
        sequences, cache, q, k, v, _Layer(None)
    )
    assert isinstance(paged, PagedMetadata) == ops.bf16_cache_ok(D)
    assert got.dtype == torch.bfloat16
    assert torch.equal(ours_cache, ref_cache)
    truth, _ = _reference_attention(cache.float(), q.float(), k.float(), v.float(), sequences, None)
    assert torch.allclose(got.float(), truth, rtol=2e-2, atol=2e-2)
    assert torch.allclose(expected.float(), truth, rtol=2e-2, atol=2e-2)


def test_backend_past_the_kernel_limits_uses_sdpa(ops):
    """More query heads per KV head than the kernel takes: the same results through SDPA."""
    sequences = SEQUENCES + LONG
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, d = 34, 2, 16
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d, generator=g)
    tokens = sum(s[0] for s in sequences)
    q = torch.randn(tokens, heads * d, generator=g)
    k = torch.randn(tokens, kv_heads * d, generator=g)
    v = torch.randn(tokens, kv_heads * d, generator=g)
    layer = _Layer(None)
    layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale = heads, kv_heads, d, d**-0.5
    paged, got, expected, ours_cache, ref_cache = _both_backends(sequences, cache, q, k, v, layer)
    assert torch.equal(ours_cache, ref_cache)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="query heads per KV head"):
        ops.paged_attention(
            q,
            k,
            v,
            cache,
            paged.slot_mapping,
            paged.seq_ranges,
            paged.block_tables,
            heads,
            kv_heads,
            d,
            d**-0.5,
            None,
            torch.empty_like(q),
        )


def test_inverse_cdf_sampling_finds_the_uniform_in_the_running_sum(ops):
    """The fused search picks what softmax + cumsum + searchsorted pick (reference in
    float64), never a masked token, and the edges: u -> 0 the first token with mass, u = 1
    the last one, a row without a finite logit the last token."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 48, 1000  # 15 full blocks of 64 and a partial one
    logits = torch.randn(rows, vocab, generator=g) * 4
    masked = torch.rand(rows, vocab, generator=g) < 0.3
    logits[masked] = float("-inf")
    logits[5, :900] = float("-inf")  # mass only in the last blocks
    logits[6, 100:] = float("-inf")  # mass only in the first ones
    uniform = torch.rand(rows, generator=g).clamp_(min=1e-6)
    got = ops.sample_inverse_cdf(logits, uniform)
    cdf = logits.double().softmax(-1).cumsum(-1)
    target = uniform.double()[:, None] * cdf[:, -1:]
    expected = torch.searchsorted(cdf, target).squeeze(-1)
    # Away from a step of the CDF (by more than float32 rounding) the choice is the same.
    lo = torch.where(expected > 0, cdf.gather(1, (expected - 1).clamp(min=0)[:, None])[:, 0], 0)
    hi = cdf.gather(1, expected[:, None])[:, 0]
    clear = ((target[:, 0] - lo) > 1e-5) & ((hi - target[:, 0]) > 1e-5)
    assert clear.sum() > rows // 2
    assert torch.equal(got[clear], expected[clear])
    assert not masked[torch.arange(rows), got].any()

    has_mass = torch.isfinite(logits)
    first = has_mass.float().argmax(-1)
    last = vocab - 1 - has_mass.flip(-1).float().argmax(-1)
    tiny = torch.full((rows,), torch.finfo(torch.float32).tiny)
    assert torch.equal(ops.sample_inverse_cdf(logits, tiny), first)
    top = ops.sample_inverse_cdf(logits, torch.ones(rows))
    assert torch.equal(top, last) or (
        # (as in the reference, a tail below float32 rounding of the total is not reached)
        has_mass[torch.arange(rows), top].all()
        and (1 - cdf.gather(1, top[:, None])[:, 0] < 1e-6).all()
    )
    assert (top >= last - 3).all() and (top == last).sum() > rows // 2

    dead = torch.full((2, 70), float("-inf"))
    assert ops.sample_inverse_cdf(dead, torch.full((2,), 0.5)).tolist() == [69, 69]
    # Rows of a wider buffer (a row stride), and the checks on what it takes.
    wide = torch.randn(4, 1100, generator=g)
    u = torch.rand(4, generator=g)
    assert torch.equal(
        ops.sample_inverse_cdf(wide[:, :1000], u),
        ops.sample_inverse_cdf(wide[:, :1000].contiguous(), u),
    )
    with pytest.raises(TypeError):
        ops.sample_inverse_cdf(wide.double(), u)
    with pytest.raises(ValueError):
        ops.sample_inverse_cdf(wide, u[:3])


# x86 targets whose code paths differ: AVX2 only; AVX-512 without VNNI or BF16; VNNI
# without BF16 (Cascade Lake, Ice Lake); VNNI and BF16 (Sapphire Rapids, Zen 4).
MARCH_TARGETS = ["haswell", "skylake-avx512", "icelake-server", "sapphirerapids"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", MARCH_TARGETS)
def test_kernels_compile_for_every_x86_code_path(march, tmp_path):
    """Each kernel source builds for every x86 feature set its paths are chosen by (the
    session machines differ; a source that fails for one falls back to torch there)."""
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    for source in sorted(CSRC.glob("*.c")):
        result = subprocess.run(
            # (an object file: some target mismatches surface only when inlining)
            [
                compiler,
                "-O1",
                f"-march={march}",
                "-fopenmp",
                "-c",
                "-o",
                str(tmp_path / "k.o"),
                str(source),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if "bad value" in result.stderr:
            pytest.skip(f"this compiler does not know -march={march}")
        assert result.returncode == 0, f"{source.name} for {march}:\n{result.stderr[-2000:]}"
