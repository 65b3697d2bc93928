"""``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` and ``--calculate-kv-scales``:
keys and values stored in one byte, lossy at run time, so checked against transformers
within stated tolerances; the memory they save, in blocks and bytes; and the same tokens
and logprobs whether a prompt is computed in one step, in chunks or from cached blocks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.attention import from_cache, to_cache

PROMPTS = [[1, 5, 9, 23, 42, 77, 3, 18, 40, 2, 6], [1, 7, 7, 7, 3, 100, 12, 64, 8, 19, 2]]
NEW_TOKENS = 10
# Largest difference allowed from transformers' float32 logprobs of the chosen tokens
# (measured on this model: 0.020 for e4m3 with scale 1.0, 0.018 for e5m2, 0.017 for e4m3
# with --calculate-kv-scales).
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_reference(checkpoint)
    return [reference_greedy(model, p, NEW_TOKENS, num_logprobs=1) for p in PROMPTS]


def _run(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        results.append((completion.token_ids, logprobs))
    return results


def test_round_trip():
    x = torch.randn(64, 2, 16) * 3
    for dtype, scale, relative in (
        (torch.float8_e4m3fn, 0.05, 2**-4),
        (torch.float8_e5m2, 1.0, 2**-3),
    ):
        stored = to_cache(x, dtype, scale)
        assert stored.dtype == dtype
        back = from_cache(stored, torch.float32, scale)
        assert ((back - x).abs() <= x.abs() * relative + scale * 2**-9 * 8).all()
    # Past the format's range: clamped, never inf or NaN.
    big = to_cache(torch.tensor([1e6, -1e6]), torch.float8_e4m3fn, 1.0).float()
    assert big.tolist() == [448.0, -448.0]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "scales"),
    [("fp8", False), ("fp8_e4m3", False), ("fp8_e5m2", False), ("fp8", True)],
)
def test_greedy_within_tolerance(checkpoint, reference, kv_cache_dtype, scales):
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=scales,
        disable_log_stats=True,
    )
    cache = llm.llm_engine.runner.kv_caches[0]
    assert cache.dtype == (
        torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    )
    for (tokens, logprobs), (expected, top) in zip(_run(llm), reference, strict=True):
        assert tokens == expected
        steps = enumerate(zip(logprobs, tokens, strict=True))
        worst = max(abs(lp - top[i][t]) for i, (lp, t) in steps)
        assert worst < TOLERANCE
    layers = [m for m in llm.llm_engine.loaded.model.modules() if type(m).__name__ == "Attention"]
    if scales:  # computed once, from the first batch, per layer
        assert all(m.k_scale != 1.0 and m.v_scale != 1.0 for m in layers)
        assert len({m.k_scale for m in layers}) == len(layers)
        assert not any(m.calculate_kv_scales for m in layers)
    else:
        assert all(m.k_scale == 1.0 and m.v_scale == 1.0 for m in layers)


def test_quantization_is_real(checkpoint):
    """(The fp8 cache changes the numbers: the float cache gives other logprobs.)"""
    fp8 = _run(LLM(str(checkpoint), dtype="float32", kv_cache_dtype="fp8", disable_log_stats=True))
    auto = _run(LLM(str(checkpoint), dtype="float32", disable_log_stats=True))
    assert max(abs(a - b) for a, b in zip(fp8[0][1], auto[0][1], strict=True)) > 1e-4


def test_memory(checkpoint, monkeypatch):
    """The same KV budget holds 4x the blocks of a float32 cache (2x a bfloat16 one),
    and the same blocks take a quarter of the bytes."""
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", str(2**-10))  # 1 MiB
    blocks, nbytes = {}, {}
    for kv in ("auto", "fp8"):
        for dtype in ("float32", "bfloat16"):
            llm = LLM(
                str(checkpoint),
                dtype=dtype,
                kv_cache_dtype=kv,
                max_model_len=64,
                disable_log_stats=True,
            )
            blocks[kv, dtype] = llm.llm_engine.kv_manager.block_pool.num_blocks
            caches = llm.llm_engine.runner.kv_caches
            nbytes[kv, dtype] = sum(c.nbytes for c in caches) / blocks[kv, dtype]
    assert blocks["fp8", "float32"] == 4 * blocks["auto", "float32"]
    assert blocks["fp8", "bfloat16"] == 2 * blocks["auto", "bfloat16"]
    assert nbytes["fp8", "float32"] * 4 == nbytes["auto", "float32"]


def test_chunked_prefill_and_prefix_caching_agree(checkpoint):
    """Prefills read their keys back from the fp8 cache: one step, chunks of 4 tokens and
    a prompt whose first blocks are cached all give the same tokens, and logprobs within
    float32 rounding. (fp8 attention is torch's SDPA, whose sums are blocked by the
    number of queries: a 37-query prefill and a 1-query last chunk may round 1 ulp apart;
    unquantized keys in the prefill would differ by about 1e-2, fp8's error.)"""
    prompt = list(range(3, 3 + 37))
    whole = LLM(
        str(checkpoint),
        dtype="float32",
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        disable_log_stats=True,
    )
    chunked = LLM(
        str(checkpoint),
        dtype="float32",
        kv_cache_dtype="fp8",
        enable_chunked_prefill=True,
        max_num_batched_tokens=4,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    [(tokens, logprobs)] = _run(whole, [prompt])
    for _ in range(2):  # the second time from cached blocks
        [(chunked_tokens, chunked_logprobs)] = _run(chunked, [prompt])
        assert chunked_tokens == tokens
        assert chunked_logprobs == pytest.approx(logprobs, rel=0, abs=1e-5)
    assert chunked.llm_engine.kv_manager.block_pool.cached_block_hash_to_block


def test_refusals(checkpoint):
    with pytest.raises(ConfigError, match="--calculate-kv-scales"):
        LLM(str(checkpoint), calculate_kv_scales=True)
    with pytest.raises(ConfigError, match="fp8_e5m2 is stored without scales"):
        LLM(str(checkpoint), kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True)
    # A backend that does not declare fp8 caches (the dummy plugin's) is not handed one.
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8: the dummy_attn attention"):
        LLM(str(checkpoint), device="dummydev", kv_cache_dtype="fp8")
