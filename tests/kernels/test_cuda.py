"""The cuda device on a real GPU: its Triton kernels compiled (against their torch
references), every tiny architecture's greedy tokens against transformers in float32
with CUDA graphs (and eagerly, and with -O3), prefix caching, chunked prefill and
preemption; the profiled KV-cache size; --dtype auto; GGUF weights through the Triton
GGUF kernels.

Skipped without a CUDA GPU. Run it there with Triton compiling (the test suite's
conftest otherwise sets TRITON_INTERPRET=1 for the CPU tests):
``TRITON_INTERPRET=0 python -m pytest tests/kernels/test_cuda.py``.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from tiny_models import ARCHITECTURES, load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache.spec import kv_cache_spec
from pagedllm.kernels.triton_attention import interpreted, triton_available

if not (torch.cuda.is_available() and triton_available() and not interpreted()):
    pytest.skip(
        "needs a CUDA GPU and Triton compiling for it (TRITON_INTERPRET=0)",
        allow_module_level=True,
    )

from test_cpu_ops import (
    SEQUENCES,
    _batch,
    _kernel_inputs,
    _reference_attention,
)

from pagedllm.kernels.attention import write_kv_cache
from pagedllm.kernels.norms import rms_norm
from pagedllm.kernels.rotary import apply_rotary
from pagedllm.kernels.triton_attention import (
    token_sequences,
    triton_paged_attention,
    triton_rms_norm,
    triton_rotary_neox_,
    triton_silu_mul,
    triton_write_kv_cache,
)
from pagedllm.plugins.devices.cuda import CudaDevice
from pagedllm.plugins.devices.cuda_graphs import DecodeGraphs

CUDA = torch.device("cuda")
GENERATION = [name for name in ARCHITECTURES]
NEW_TOKENS = 10


def _free() -> None:
    """Free what the engines of a test held on the GPU: an engine freezes the garbage
    collector's objects until it shuts down, so those left running are collected only
    once unfrozen; then the allocator's cache goes back."""
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _free_after_each_test():
    """(An engine a test left running would count in the next one's profiled peak.)"""
    yield
    _free()


def _prompts(seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(6, 512, (24,), generator=g).tolist()
    return [shared + torch.randint(6, 512, (n,), generator=g).tolist() for n in (3, 14, 40)]


# ---------------------------------------------------------------- NCCL


def test_nccl_carries_the_parallel_collectives_on_the_gpu():
    """The collectives and transfers tensor and pipeline parallelism use, over NCCL on
    this GPU: a group of one rank (NCCL refuses two ranks on one device), joined as the
    engine's ranks join theirs. The all-reduce, the all-gather of a vocabulary split and
    a stage's point-to-point send (to itself) carry GPU tensors."""
    import torch.distributed as dist

    from pagedllm.executors.mp import _free_port, collective_backend

    assert collective_backend("cuda") == "nccl"
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        x = torch.arange(12.0, device=CUDA).reshape(3, 4)
        dist.all_reduce(summed := x.clone())
        torch.testing.assert_close(summed, x)
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x)
        torch.testing.assert_close(parts[0], x)
        got = torch.empty_like(x, dtype=torch.bfloat16)
        ops = [
            dist.P2POp(dist.isend, x.to(torch.bfloat16), 0),
            dist.P2POp(dist.irecv, got, 0),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        torch.testing.assert_close(got, x.to(torch.bfloat16))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- kernels, compiled


def test_kv_cache_write_on_the_gpu():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 16, 3, 16, generator=g)
    key, value = torch.randn(2, 5, 3 * 16, generator=g)
    slots = torch.tensor([17, 3, 90, 40, 41])
    expected = cache.clone()
    write_kv_cache(key.view(5, 3, 16), value.view(5, 3, 16), expected, slots)
    ours = cache.to(CUDA)
    triton_write_kv_cache(key.to(CUDA), value.to(CUDA), ours, slots.to(CUDA))
    assert torch.equal(ours.cpu(), expected)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, None), (None, 5.0)])
def test_paged_attention_on_the_gpu(window, softcap):
    """A step of decodes, chunks over cached context and a prompt, against float64."""
    cache, q, k, v = _batch(SEQUENCES)
    slots, ranges, tables = _kernel_inputs(SEQUENCES)
    expected, _ = _reference_attention(cache, q, k, v, SEQUENCES, window, soft_cap=softcap)
    gpu_cache = cache.to(CUDA)
    triton_write_kv_cache(k.to(CUDA), v.to(CUDA), gpu_cache, slots.to(CUDA))
    got = triton_paged_attention(
        q.to(CUDA).contiguous(),
        gpu_cache,
        ranges.to(CUDA),
        tables.to(CUDA),
        q.shape[1] // 64,
        cache.shape[3],
        64,
        64**-0.5,
        window,
        softcap=softcap,
        token_seq=token_sequences(ranges, q.shape[0]).to(CUDA),
    )
    assert torch.allclose(got.cpu().double(), expected.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_rope_and_silu_on_the_gpu(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 96, generator=g).to(dtype).to(CUDA)
    residual = torch.randn(37, 96, generator=g).to(dtype).to(CUDA)
    weight = torch.randn(96, generator=g).to(dtype).to(CUDA)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(triton_rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **tol)
    total, normed = triton_rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(total, residual + x)
    assert torch.allclose(normed, rms_norm(residual + x, weight, 1e-6), **tol)
    q = torch.randn(37, 4, 32, generator=g).to(dtype).to(CUDA)
    key = torch.randn(37, 2, 32, generator=g).to(dtype).to(CUDA)
    positions = torch.randint(0, 100, (37,), generator=g).to(CUDA)
    angles = torch.arange(100)[:, None] * torch.rand(16, generator=g)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(CUDA), emb.sin().to(CUDA)
    expected_q = apply_rotary(q, cos[positions].to(dtype), sin[positions].to(dtype))
    expected_k = apply_rotary(key, cos[positions].to(dtype), sin[positions].to(dtype))
    triton_rotary_neox_(q, key, positions, cos, sin, 32)
    assert torch.allclose(q, expected_q, **tol) and torch.allclose(key, expected_k, **tol)
    gate, up = torch.randn(2, 37, 200, generator=g).to(dtype).to(CUDA)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.allclose(triton_silu_mul(gate, up), expected, **tol)


# ---------------------------------------------------------------- models


def test_eager_preemption_and_o3(tmp_path):
    """--enforce-eager, a KV cache too small for every request at once (preemption), and
    -O3 (TorchInductor) with graphs: the same greedy tokens."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    reference = load_reference(directory)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for kwargs in (
        dict(enforce_eager=True),
        dict(num_gpu_blocks_override=12, block_size=8, max_model_len=96),
        dict(compilation_config=3),
    ):
        llm = LLM(str(directory), device="cuda", dtype="float32", max_num_seqs=8, **kwargs)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, kwargs
        runner = llm.llm_engine.runner
        if "enforce_eager" in kwargs:
            assert runner.graphs is None
        else:
            assert runner.graphs is not None and runner.graphs.replays > 0
        if "num_gpu_blocks_override" in kwargs:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        del llm, runner
        _free()


def test_the_kv_cache_takes_what_the_profiled_peak_leaves(tmp_path):
    """A model with 1 MiB KV blocks and room for more blocks than the budget holds: the
    cache fills the fraction less the profiled peak (within a block and what is held
    outside PyTorch), and the process stays under the fraction."""
    wide = dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_hidden_layers=8,
        max_position_embeddings=8192,
    )
    directory = make_checkpoint(tmp_path / "llama", "llama", **wide)
    total = torch.cuda.mem_get_info()[1]
    for fraction in (0.2, 0.4):
        llm = LLM(
            str(directory),
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=fraction,
            enforce_eager=True,
        )
        engine = llm.llm_engine
        device = engine.config.device_config.device
        assert isinstance(device, CudaDevice) and device.peak_bytes > 0
        per_block = kv_cache_spec(engine.loaded.hf_config, torch.float32).bytes_per_block(16)
        assert per_block == 2**20
        kv_bytes = engine.kv_manager.num_blocks * per_block
        # (the budget decided, not the cap of --max-num-seqs full-length requests)
        assert engine.kv_manager.num_blocks < 256 * 8192 // 16
        budget = fraction * total - device.peak_bytes
        assert budget - 0.01 * total < kv_bytes <= budget
        assert torch.cuda.memory_reserved() <= fraction * total
        del llm, engine, device
        _free()
    with pytest.raises(ConfigError, match="gpu-memory-utilization=0.0001.*profiled peak"):
        LLM(str(directory), device="cuda", dtype="float32", gpu_memory_utilization=0.0001)
    _free()


def test_auto_dtype_and_half_precision_parity(tmp_path):
    """--dtype auto: float16 for a float32 checkpoint, bfloat16 for a bfloat16 one; the
    first greedy tokens agree with transformers on the GPU in that dtype."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(directory), device="cuda")
    assert llm.llm_engine.loaded.dtype == torch.float16
    del llm
    _free()
    import transformers

    bf16 = tmp_path / "bf16"
    shutil.copytree(directory, bf16)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model.save_pretrained(bf16)
    llm = LLM(str(bf16), device="cuda")
    assert llm.llm_engine.loaded.dtype == torch.bfloat16
    reference = model.to(CUDA).eval()
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt], device=CUDA),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
            )
        assert output.outputs[0].token_ids == out[0, len(prompt) :].tolist()
    del llm, reference
    _free()


def test_gguf_weights_on_the_gpu(tmp_path):
    """A Q4_1 GGUF model's packed weights decoded by the Triton GGUF kernels: the tokens
    transformers gives on the same stored weights."""
    from gguf import GGMLQuantizationType
    from gguf_writer import gguf_checkpoint

    directory, path, model = gguf_checkpoint(tmp_path, "llama", GGMLQuantizationType.Q4_1)
    prompts = _prompts()
    expected = [reference_greedy(model, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(path), tokenizer=str(directory), device="cuda", dtype="float32")
    packed = [
        n for n, p in llm.llm_engine.loaded.model.named_parameters() if p.dtype == torch.uint8
    ]
    assert packed and all(p.is_cuda for p in llm.llm_engine.loaded.model.parameters())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    del llm
    _free()


# (Last: the longest, so that a time limit cuts it rather than the rest.)
@pytest.mark.parametrize("architecture", GENERATION)
def test_greedy_parity_with_cuda_graphs(architecture, tmp_path):
    """transformers' greedy tokens (float32) on the GPU: prompts in chunks of 16 tokens
    over a shared prefix (cached on the second pass), decodes replayed from CUDA graphs."""
    directory = make_checkpoint(tmp_path / architecture, architecture)
    reference = load_reference(directory)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(
        str(directory),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.3,
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.kv_manager.total_prefix_cache_stats.hits > 0
    assert isinstance(graphs, DecodeGraphs), "CUDA graphs were not captured"
    assert graphs.replays > 0
    del llm, engine
    _free()
