"""Pipeline parallelism on CPU (gloo): ``-pp N`` runs stages 1..N-1 in worker processes,
each holding its share of the layers and of the KV cache; each step's requests go through
the stages in micro-batches, or with several steps in flight (virtual engines). Greedy
tokens equal ``-pp 1`` and transformers, offline (with prefix caching, chunked prefill and
preemption). The server, Ray stages and the other row
blocks (prompt logprobs, beams, an fp8 cache) are tested with tensor parallelism's, in
test_tensor_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_tensor_parallel import (
    NEW_TOKENS,
    _generate,
    _prompts,
    assert_parity_with_one_rank,
)
from tiny_models import load_reference, make_checkpoint, reference_greedy
from torch import nn

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.core.attention import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.weights import HeldElsewhere
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.runner import StepInput
from pagedllm.distributed.parallel_state import layer_partition, stage_layers
from pagedllm.executors.pipeline import split_micro_batches
from pagedllm.plugins.models.common import DecoderStack


def test_micro_batches_are_contiguous_runs_of_about_equal_tokens():
    lens = [5, 1, 1, 1, 2, 2]
    step = StepInput(
        token_ids=list(range(12)),
        positions=list(range(100, 112)),
        query_lens=lens,
        context_lens=[9, 4, 5, 6, 7, 8],
        block_tables=[[i] for i in range(6)],
        blocks_to_copy=[(3, 4)],
    )
    two = split_micro_batches(step, 2)
    assert [b.query_lens for b in two] == [[5, 1], [1, 1, 2, 2]]
    assert two[1].token_ids == list(range(6, 12)) and two[1].positions == list(range(106, 112))
    assert two[1].context_lens == [5, 6, 7, 8] and two[1].block_tables == [[2], [3], [4], [5]]
    # The block copies are made once, before the first micro-batch.
    assert two[0].blocks_to_copy == [(3, 4)] and two[1].blocks_to_copy == []
    assert [b.query_lens for b in split_micro_batches(step, 3)] == [[5], [1, 1, 1], [2, 2]]
    # Never more runs than requests, never an empty one.
    assert [b.query_lens for b in split_micro_batches(step, 9)] == [[n] for n in lens]
    # Layers: the later stages take the remainder (stage 0 also embeds and samples).
    assert [stage_layers(30, r, 4) for r in range(4)] == [
        range(0, 7),
        range(7, 14),
        range(14, 22),
        range(22, 30),
    ]


@pytest.mark.parametrize(
    ("architecture", "stages", "ranks", "overrides"),
    [
        ("llama", 2, 1, {}),
        ("llama", 3, 1, {"num_hidden_layers": 3}),
        ("llama", 2, 2, {}),
        ("gemma3", 2, 1, {}),
        ("gemma2", 2, 1, {}),
        ("phi3", 2, 1, {}),
        ("mixtral", 2, 1, {}),
        ("gpt2", 2, 1, {}),
        ("opt", 2, 1, {"word_embed_proj_dim": 32}),
        ("falcon", 2, 1, {}),
        ("gpt_neox", 2, 1, {}),
    ],
    ids=[
        "llama", "llama-3-stages", "llama-tp2-pp2", "gemma3", "gemma2", "phi3", "mixtral",
        "gpt2", "opt-projected", "falcon", "gpt_neox",
    ],
)  # fmt: skip
def test_stages_give_the_tokens_of_one(architecture, stages, ranks, overrides, tmp_path):
    """-pp N (and -tp 2 -pp 2: two stages of two tensor-parallel ranks each): transformers'
    greedy tokens and -pp 1's logprobs within 1e-4, prompts chunked over a cached prefix
    (second pass) in a cache small enough to preempt; the steps went through the stages
    in several micro-batches."""
    directory = make_checkpoint(tmp_path / architecture, architecture, **overrides)

    def check(engine: Any, reference: Any) -> None:
        assert len(engine.executor.procs) == stages * ranks - 1
        # Stage 0 holds its layers, the embedding and the head, not the final part; its
        # KV cache holds its layers only (and with -tp its share of their heads).
        model = engine.loaded.model
        decoder = next(m for m in model.modules() if isinstance(m, DecoderStack))
        assert not decoder.last_stage
        built = next(m for m in decoder.children() if isinstance(m, nn.ModuleList))
        layers = reference.config.num_hidden_layers
        held = [i in stage_layers(layers, 0, stages) for i in range(layers)]
        assert [not isinstance(layer, HeldElsewhere) for layer in built] == held
        assert [cache.dim() > 1 for cache in engine.runner.kv_caches] == held
        attention = next(m for m in model.modules() if isinstance(m, Attention))
        assert attention.num_heads == reference.config.num_attention_heads // ranks

    parallel = {"pipeline_parallel_size": stages, "tensor_parallel_size": ranks}
    engine = assert_parity_with_one_rank(directory, parallel, check)
    pipeline = engine.executor.pipeline
    if ranks == 1:
        # Steps in flight: stage 0 started steps while another was in the later stages.
        assert engine.step_queue is not None and len(engine.scheduler.schedulers) == stages
        assert pipeline.num_overlapped > 0 and engine.step_queue.num_overlapped > 0
    else:
        # (stage 0's tensor-parallel ranks follow whole steps: one in flight, split)
        assert engine.step_queue is None
        assert pipeline.num_micro_batches > pipeline.num_steps > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"distributed_executor_backend": "uni"}, "uni runs one process"),
        ({"pipeline_parallel_size": 0}, "--pipeline-parallel-size=0 is invalid"),
    ],
)
def test_what_pipeline_parallelism_cannot_do_is_refused(kwargs, message):
    args = EngineArgs(model="m", **{"pipeline_parallel_size": 2, **kwargs})
    with pytest.raises(ConfigError, match=message):
        args.create_engine_config(make_plugin_manager())


def test_architectures_and_depths_that_cannot_be_staged_are_refused(tmp_path):
    llama = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="TransformersForCausalLM does not support pipeline"):
        LLM(str(llama), model_impl="transformers", pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="2 layers: too few for --pipeline-parallel-size 3"):
        LLM(str(llama), dtype="float32", pipeline_parallel_size=3)


def test_gguf_weights_over_two_stages(tmp_path):
    """A GGUF model's tensors of the other stage's layers are skipped; transformers'
    tokens on the stored weights, in bfloat16 between the stages too."""
    from gguf import GGMLQuantizationType
    from gguf_writer import gguf_checkpoint

    directory, path, model = gguf_checkpoint(tmp_path, "llama", GGMLQuantizationType.Q4_1)
    prompts = _prompts()
    expected = [reference_greedy(model, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", pipeline_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    finally:
        llm.llm_engine.shutdown()
    # bfloat16 hidden states travel between the stages as they are.
    single = LLM(str(path), tokenizer=str(directory), dtype="bfloat16")
    expected = [o.outputs[0].token_ids for o in _generate(single, prompts)]
    llm = LLM(str(path), tokenizer=str(directory), dtype="bfloat16", pipeline_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    finally:
        llm.llm_engine.shutdown()


def test_a_stage_killed_within_a_step_stops_the_engine(tmp_path):
    """Stage 1 killed while the engine is generating (rank 0 in the middle of its
    transfers): the engine raises EngineDeadError naming the stage, instead of waiting
    for the transfers' timeout."""
    import os
    import signal
    import threading
    import time

    from pagedllm import SamplingParams
    from pagedllm.core.errors import EngineDeadError

    directory = make_checkpoint(
        tmp_path / "llama", "llama", hidden_size=256, intermediate_size=1024,
        num_hidden_layers=4, max_position_embeddings=2048,
    )  # fmt: skip
    llm = LLM(str(directory), dtype="float32", pipeline_parallel_size=2, disable_log_stats=True)
    stage = llm.llm_engine.executor.procs[0]
    killed: list[float] = []

    def kill() -> None:
        while llm.llm_engine.executor.pipeline.num_steps < 3:
            time.sleep(0.01)
        os.kill(stage.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    threading.Thread(target=kill, daemon=True).start()
    prompts = [{"prompt_token_ids": [5 + i % 500 for i in range(1500)]}] * 4
    try:
        with pytest.raises(EngineDeadError, match="pipeline stage 1"):
            llm.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        assert killed and time.monotonic() - killed[0] < 30
    finally:
        llm.llm_engine.shutdown()


def test_layer_partition_from_the_environment(tmp_path, monkeypatch):
    """PAGEDLLM_PP_LAYER_PARTITION (or vLLM's VLLM_PP_LAYER_PARTITION) sets each stage's
    layers: the stages hold them, with transformers' tokens; a list that does not fit
    is refused before any process starts, naming the variable."""
    env = {"VLLM_PP_LAYER_PARTITION": "1,3"}
    assert layer_partition(4, 2, env) == [1, 3]
    assert layer_partition(4, 2, {**env, "PAGEDLLM_PP_LAYER_PARTITION": "2,2"}) == [2, 2]
    assert layer_partition(5, 2, {}) == [2, 3]
    for bad in ("1,2", "0,4", "4", "1,x", "1,1,2"):
        with pytest.raises(ValueError, match=f"PAGEDLLM_PP_LAYER_PARTITION='{bad}': give 2"):
            layer_partition(4, 2, {"PAGEDLLM_PP_LAYER_PARTITION": bad})
    directory = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=4)
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,2")
    with pytest.raises(ConfigError, match="PAGEDLLM_PP_LAYER_PARTITION='1,2'"):
        LLM(str(directory), dtype="float32", pipeline_parallel_size=2)
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,3")
    reference = load_reference(directory)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(directory), dtype="float32", pipeline_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
        decoder = next(
            m for m in llm.llm_engine.loaded.model.modules() if isinstance(m, DecoderStack)
        )
        built = next(m for m in decoder.children() if isinstance(m, nn.ModuleList))
        assert [not isinstance(layer, HeldElsewhere) for layer in built] == [True] + [False] * 3
    finally:
        llm.llm_engine.shutdown()


def test_a_request_aborted_in_flight_frees_its_blocks(tmp_path):
    """Two virtual engines, each a step in flight; aborting every request while one step
    is still in the stages frees every block at once. The step comes back (nothing of it
    is output) and the blocks serve the next requests, with transformers' tokens."""
    directory = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=4)
    reference = load_reference(directory)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(directory), dtype="float32", pipeline_parallel_size=2, disable_log_stats=True)
    engine = llm.llm_engine
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        # (a new request goes to the virtual engine with the fewest)
        assert [len(s.requests) for s in engine.scheduler.schedulers] == [2, 1]
        outputs = engine.step()  # both virtual engines started a step; the first is back
        assert len(engine.step_queue) == 1 and engine.step_queue.num_overlapped == 1
        assert {o.request_id for o in outputs} == {"r0", "r2"}
        assert engine.kv_manager.usage > 0
        aborted = engine.abort_request(["r0", "r1", "r2"])
        assert sorted(o.request_id for o in aborted) == ["r0", "r1", "r2"]
        assert engine.kv_manager.usage == 0 and engine.scheduler.num_running == 0
        assert engine.has_unfinished_requests()  # (the step still in flight)
        assert engine.step() == [] and not engine.has_unfinished_requests()
        assert not engine.step_queue
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
        assert engine.kv_manager.usage == 0
    finally:
        engine.shutdown()
    assert all(not proc.is_alive() for proc in engine.executor.procs)
