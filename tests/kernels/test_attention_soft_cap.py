"""Attention logit soft-capping (Gemma 2: scores become ``cap * tanh(score / cap)``
before the softmax): the reference backend, the cpu device's backend (its C kernel caps
the scores of decodes and short chunks, in every build: the AVX-512 ones send capped layers
past their tiles to the loop the generic build runs) and the Triton backend against a
float64 reference, on one step of decodes, chunks over cached context and whole prompts;
models with such layers on a backend that does not compute it are refused by name before
their weights load."""

from __future__ import annotations

import math

import pytest
import torch
from test_cpu_ops import (
    LONG,
    SEQUENCES,
    _batch,
    _kernel_inputs,
    _march_ops,
    _metadata_args,
    _reference_attention,
)
from tiny_models import make_checkpoint

from pagedllm import LLM
from pagedllm.core.attention import Attention
from pagedllm.core.attention.torch_backend import TorchSDPABackend
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.triton_attention import triton_available
from pagedllm.plugins.devices import cpu_attention
from pagedllm.plugins.devices.cpu_attention import CpuPagedBackend, PagedMetadata

HEADS, KV_HEADS, D, CAP = 9, 3, 64, 2.0


def _layer(window: int | None, cap: float | None = CAP) -> Attention:
    return Attention(HEADS, D, D**-0.5, KV_HEADS, 0, window, logits_soft_cap=cap)


def _step(sequences, backend, layer, seed):
    """``backend``'s metadata and output for one step, the cache it wrote, and the
    float64 truth: output, cache and the output without the cap."""
    cache, q, k, v = _batch(sequences, seed=seed)
    q = q * 6  # (scores large enough that capping them matters)
    window, cap = layer.sliding_window, layer.logits_soft_cap
    truth, truth_cache = _reference_attention(cache, q, k, v, sequences, window, soft_cap=cap)
    uncapped, _ = _reference_attention(cache, q, k, v, sequences, window)
    cache = cache.clone()
    metadata = backend.build_metadata(*_metadata_args(sequences), [cache], torch.device("cpu"))
    got = metadata.backend.forward(layer, q, k, v, metadata)
    assert torch.allclose(cache.view(truth_cache.shape), truth_cache)
    return metadata, got, truth, uncapped


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("sequences", [SEQUENCES + LONG, [(1, 37, [5, 9, 2]), (1, 9, [11])]])
@pytest.mark.parametrize("backend_cls", [TorchSDPABackend, CpuPagedBackend])
def test_torch_and_cpu_backends_cap_the_scores(backend_cls, sequences, window):
    """Mixed steps and decode-only steps (the reference backend's shortcut)."""
    assert backend_cls.logits_soft_cap
    _, got, truth, uncapped = _step(sequences, backend_cls(), _layer(window), seed=11)
    assert torch.allclose(got, truth, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, uncapped, rtol=1e-2, atol=1e-2)


def test_the_cpu_kernel_takes_capped_and_uncapped_layers(monkeypatch):
    """The same step with and without a cap: the C kernel's path (where it is built),
    counted."""
    from pagedllm.kernels.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels are not built")
    calls = []
    original = type(ops).paged_attention
    monkeypatch.setattr(
        type(ops),
        "paged_attention",
        lambda self, *a: calls.append(1) or original(self, *a),
    )
    sequences = SEQUENCES
    _, got, truth, _ = _step(sequences, CpuPagedBackend(), _layer(None, cap=None), seed=12)
    assert calls and torch.allclose(got, truth, rtol=1e-5, atol=1e-5)
    calls.clear()
    metadata, got, truth, uncapped = _step(sequences, CpuPagedBackend(), _layer(None), seed=12)
    assert isinstance(metadata, PagedMetadata) and calls
    assert torch.allclose(got, truth, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, uncapped, rtol=1e-2, atol=1e-2)
    assert cpu_attention.KERNEL_MAX_QUERY >= max(s[0] for s in sequences)


def _build(march: str):
    """The CPU kernels compiled for ``march`` (``native``: this CPU's build)."""
    if march != "native":
        return _march_ops(march)
    from pagedllm.kernels.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels are not built")
    return ops


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_every_kernel_build_caps_the_scores(march, cache_dtype):
    """This CPU's build, the AVX2 one and the generic x86-64 one (the loop that AVX-512
    builds give capped layers) cap the scores of decodes and short chunks, over a float32
    or bfloat16 cache, as the float64 truth does; each sequence alone gives the batch's
    bits."""
    ops = _build(march)
    if cache_dtype == torch.bfloat16 and not ops.bf16_cache_ok(D):
        pytest.skip("this build reads no bfloat16 cache")
    sequences = [*SEQUENCES, (24, 50, [23, 24, 25, 26])]
    cache, q, k, v = _batch(sequences, seed=14)
    q = q * 6
    window = 24
    if cache_dtype == torch.bfloat16:  # (what the kernel stores: bfloat16 rows)
        cache, k, v = cache.bfloat16(), k.bfloat16().float(), v.bfloat16().float()
    truth, _ = _reference_attention(cache.float(), q, k, v, sequences, window, soft_cap=CAP)
    uncapped, _ = _reference_attention(cache.float(), q, k, v, sequences, window)

    def attend(rows, seqs):
        out = torch.full((rows.stop - rows.start, HEADS * D), math.nan)
        ops.paged_attention(
            q[rows], k[rows], v[rows], cache.clone(), *_kernel_inputs(seqs), HEADS, KV_HEADS,
            D, D**-0.5, window, out, CAP,
        )  # fmt: skip
        return out

    whole = attend(slice(0, q.shape[0]), sequences)
    assert torch.allclose(whole, truth, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole, uncapped, rtol=1e-2, atol=1e-2)
    offset = 0
    for seq in sequences:
        rows = slice(offset, offset + seq[0])
        assert torch.equal(attend(rows, [seq]), whole[rows]), seq
        offset += seq[0]


def test_a_soft_cap_must_be_positive():
    ops = _build("native")
    cache, q, k, v = _batch(SEQUENCES, seed=15)
    out = torch.empty(q.shape[0], HEADS * D)
    with pytest.raises(ValueError, match="soft_cap must be positive"):
        ops.paged_attention(
            q, k, v, cache, *_kernel_inputs(SEQUENCES), HEADS, KV_HEADS, D, D**-0.5, None,
            out, 0.0,
        )  # fmt: skip


@pytest.mark.skipif(not triton_available(), reason="needs the triton package")
@pytest.mark.parametrize("window", [None, 24])
def test_triton_backend_caps_the_scores(window):
    from pagedllm.plugins.devices.cuda_attention import TritonPagedBackend

    _, got, truth, uncapped = _step(SEQUENCES + LONG, TritonPagedBackend(), _layer(window), 13)
    assert torch.allclose(got, truth, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, uncapped, rtol=1e-2, atol=1e-2)


def test_a_backend_without_soft_capping_is_refused(tmp_path, monkeypatch):
    """The dummy plugin's attention backend (written from the contract, no soft-cap):
    Gemma 2 is refused by name before its weights load; an uncapped model runs on it."""
    directory = make_checkpoint(tmp_path / "gemma2", "gemma2")
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "dummy_attn")
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM soft-caps.*dummy_attn"):
        LLM(str(directory), dtype="float32")
    uncapped = make_checkpoint(tmp_path / "uncapped", "gemma2", attn_logit_softcapping=None)
    llm = LLM(str(uncapped), dtype="float32", disable_log_stats=True)
    assert llm.llm_engine.runner.attention_backend.name == "dummy_attn"
