"""The cuda device's runner parts that run without a GPU: the decode-graph buffers and
their padding (run without capturing, on the Triton backend under the interpreter),
-O levels through torch.compile, the compilation settings and their refusals, and the
profiled step. tests/kernels/test_cuda.py checks the same on a GPU, where there is one."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.core.compilation import compilation_config, graph_sizes
from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache.spec import kv_cache_spec
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.runner import profile_step
from pagedllm.plugins.devices.cpu import CpuDevice

pytest.importorskip("triton")

from pagedllm.plugins.devices.cuda_attention import TritonPagedBackend
from pagedllm.plugins.devices.cuda_graphs import DecodeGraphs, decode_graphs


def _prompts(count: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 512, (n,), generator=g).tolist() for n in (5, 11, 3, 17, 8)[:count]]


def test_graph_sizes_follow_the_seeds():
    assert graph_sizes([20]) == [1, 2, 4, 8, 16]
    assert graph_sizes([512])[-3:] == [496, 504, 512]
    assert graph_sizes([5, 3, 3]) == [3, 5]
    args = EngineArgs(model="m", cuda_graph_sizes=[64])
    # Past --max-num-seqs only the first size that covers it is kept.
    assert compilation_config(args, max_num_seqs=10).capture_sizes == [1, 2, 4, 8, 16]
    assert compilation_config(args, max_num_seqs=16).capture_sizes == [1, 2, 4, 8, 16]
    eager = EngineArgs(model="m", enforce_eager=True, compilation_config=3)
    config = compilation_config(eager, max_num_seqs=256)
    assert (config.level, config.capture_sizes) == (3, [])
    json = EngineArgs(model="m", compilation_config={"level": 2, "CUDAgraph_capture_sizes": [4, 1]})
    config = compilation_config(json, max_num_seqs=256)
    assert (config.level, config.capture_sizes) == (2, [1, 4])
    off = EngineArgs(model="m", compilation_config={"use_cudagraph": False})
    assert compilation_config(off, max_num_seqs=256).capture_sizes == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compilation_config": {"level": 3, "splitting_ops": []}}, "'splitting_ops' is not"),
        ({"compilation_config": {"level": 7}}, "level 7 is not one of"),
        ({"cuda_graph_sizes": [8]}, "--cuda-graph-sizes does not apply to the cpu device"),
        ({"max_seq_len_to_capture": 64}, "--max-seq-len-to-capture does not apply to the cpu"),
        (
            {"compilation_config": {"cudagraph_capture_sizes": [1]}},
            "cudagraph_capture_sizes and use_cudagraph do not apply to the cpu",
        ),
    ],
)
def test_compilation_settings_without_effect_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="m", **kwargs).create_engine_config(make_plugin_manager())


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The cpu device as a device that captures graphs, whose replayer runs the graph
    buffers without capturing (no GPU here); attention on the Triton backend."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton_paged")
    monkeypatch.setattr(CpuDevice, "captures_graphs", True)

    def uncaptured(self, runner, config):
        return decode_graphs(runner, config, use_graphs=False)

    monkeypatch.setattr(CpuDevice, "decode_graphs", uncaptured)


def test_decode_steps_from_the_graph_buffers_keep_greedy_parity(graphs_on_cpu, tmp_path):
    """Decode steps padded to the capture sizes (3 requests run as 4, padding rows in the
    spare block) give transformers' greedy tokens; contexts past --max-seq-len-to-capture
    and the prompts' steps run eagerly, with prefix caching and preemption (a cache too
    small for all three requests) on."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    reference = load_reference(directory)
    prompts = _prompts(3)
    llm = LLM(
        str(directory),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=3,
        cuda_graph_sizes=[1, 2, 4],
        max_seq_len_to_capture=24,
        num_gpu_blocks_override=7,
        block_size=8,
        disable_log_stats=True,
    )
    runner = llm.llm_engine.runner
    assert isinstance(runner.attention_backend, TritonPagedBackend)
    graphs = runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    # The spare block past the KV manager's.
    assert runner.pad_block == 7 and runner.kv_caches[0].shape[1] == 8
    params = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=14)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 14)[0]
    assert graphs.replays > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_enforce_eager_captures_nothing(graphs_on_cpu, tmp_path):
    directory = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(directory), dtype="float32", enforce_eager=True, disable_log_stats=True)
    assert llm.llm_engine.runner.graphs is None
    assert llm.llm_engine.runner.pad_block == llm.llm_engine.runner.kv_caches[0].shape[1]


@pytest.mark.parametrize("level", [1, 3])
def test_compilation_levels_keep_greedy_parity(level, tmp_path):
    """-O1 (TorchDynamo graphs as traced) and -O3 (TorchInductor) on the cpu: the same
    greedy tokens as transformers, prompts and decodes through the compiled forward."""
    from torch._dynamo.utils import counters

    directory = make_checkpoint(tmp_path / "llama", "llama")
    reference = load_reference(directory)
    prompts = _prompts(2)
    counters.clear()
    llm = LLM(str(directory), dtype="float32", compilation_config=level, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 6)[0]
    # Traced: the model's own layers in graphs, split only at attention (the CPU
    # kernels' library calls are left to Inductor under compilation).
    assert counters["stats"]["unique_graphs"] > 0
    breaks = counters["graph_break"]
    assert breaks and all("_attend_uncompiled" in reason for reason in breaks), dict(breaks)


def test_the_profiled_step_returns_its_throwaway_cache(tmp_path):
    directory = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True)
    runner = llm.llm_engine.runner
    spec = kv_cache_spec(llm.llm_engine.loaded.hf_config, torch.float32)

    def profile(**kwargs) -> int:
        return profile_step(
            runner.model, runner.attention_backend, spec, 16, device=torch.device("cpu"), **kwargs
        )

    # 100 tokens over 3 requests (34, 33, 33): 3 blocks each.
    assert profile(num_tokens=100, num_seqs=3) == 9 * spec.bytes_per_block(16)
    # No request longer than the context: 2 requests of 20 tokens (2 blocks each).
    excluded = profile(num_tokens=100, num_seqs=2, max_model_len=20)
    assert excluded == 4 * spec.bytes_per_block(16)


def test_the_dense_experts_path_is_the_reference():
    """moe_dense (every expert over every token, weighted 0 where not chosen: what a
    captured GPU decode step runs) against moe_reference."""
    import torch.nn.functional as F

    from pagedllm.kernels.moe import moe_dense, moe_reference, select_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g, dtype=torch.float64)
    gate_up = torch.randn(4, 24, 16, generator=g, dtype=torch.float64)
    down = torch.randn(4, 16, 12, generator=g, dtype=torch.float64)
    weights, ids = select_experts(torch.randn(7, 4, generator=g), 2, renormalize=True)
    weights = weights.double()
    expected = moe_reference(x, gate_up, down, weights, ids, F.silu)
    assert torch.allclose(moe_dense(x, gate_up, down, weights, ids, F.silu), expected, atol=1e-12)


def test_the_kv_budget_leaves_other_processes_their_memory():
    """Two engines at --gpu-memory-utilization 0.5 on one GPU: the second one's budget is
    its own half less its peak and what it holds outside PyTorch, not less the first
    engine's memory; asking for more than was free at start is refused."""
    from pagedllm.plugins.devices.cuda import kv_cache_budget

    gib = 2**30
    # 100 GiB GPU, 45 GiB held by another engine; this one loaded 15 GiB (12 in PyTorch's
    # allocator), its profiled peak 10 GiB.
    budget = kv_cache_budget(0.5, 100 * gib, 55 * gib, 40 * gib, 12 * gib, 10 * gib)
    assert budget.num_bytes == 37 * gib
    assert "profiled peak of 10.00 GiB" in budget.source
    with pytest.raises(ConfigError, match=r"0\.6 asks for 60\.00 GiB.*only 55\.00 GiB were free"):
        kv_cache_budget(0.6, 100 * gib, 55 * gib, 40 * gib, 12 * gib, 10 * gib)
    # Never more than is free now.
    assert kv_cache_budget(0.5, 100 * gib, 60 * gib, 20 * gib, 40 * gib, 0).num_bytes == 20 * gib


def test_the_dense_experts_path_ignores_unchosen_experts_overflow():
    """An expert a token did not choose may overflow (inf) on it: its weight 0 must not
    turn the token's output into NaN."""
    import torch.nn.functional as F

    from pagedllm.kernels.moe import moe_dense, moe_reference

    x = torch.ones(2, 4)
    gate_up = torch.ones(2, 8, 4)
    gate_up[1] *= 1e30  # expert 1 overflows
    down = torch.ones(2, 4, 4)
    weights, ids = torch.tensor([[1.0], [1.0]]), torch.tensor([[0], [0]])
    dense = moe_dense(x, gate_up, down, weights, ids, F.silu)
    assert torch.isfinite(dense).all()
    assert torch.equal(dense, moe_reference(x, gate_up, down, weights, ids, F.silu))


def test_padding_rows_touch_only_the_spare_block(graphs_on_cpu, tmp_path):
    """Three decodes run as a batch of four: the cache changes only at the three
    requests' slots and in the spare block."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(
        str(directory),
        dtype="float32",
        cuda_graph_sizes=[4],
        num_gpu_blocks_override=6,
        block_size=8,
        disable_log_stats=True,
    )
    runner = llm.llm_engine.runner
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    hidden = runner.graphs.run([5, 6, 7], [0, 3, 9], [1, 4, 10], [[2], [4], [1, 3]])
    assert hidden.shape[0] == 3 and torch.isfinite(hidden).all()
    written = {(2, 0), (4, 3), (3, 1)}  # (block, offset) of each request's new token
    for old, new in zip(before, runner.kv_caches, strict=True):
        changed = (old != new).flatten(3).any(-1).any(0)  # [blocks, block_size]
        assert {tuple(i) for i in changed[: runner.pad_block].nonzero().tolist()} == written
        assert changed[runner.pad_block].any()
