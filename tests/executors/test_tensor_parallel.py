"""Tensor parallelism on CPU (gloo): ``-tp 2`` runs rank 1 in a worker process that
follows rank 0's steps; greedy tokens equal ``-tp 1`` and transformers, offline (with
prefix caching, chunked prefill and preemption) and through the server; a worker that
dies stops the server (``/health`` 503, exit) rather than hanging it. The tests of what
tensor and pipeline parallelism share (the server, Ray, the other row blocks) run for
both (the rest of pipeline parallelism: test_pipeline_parallel.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
import pytest
import torch
from openai_server import RemoteServer
from tiny_models import load_reference, make_checkpoint, make_classifier, reference_greedy

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.core.attention import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.plugins import make_plugin_manager

NEW_TOKENS = 8


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(6, 512, (20,), generator=g).tolist()
    return [shared + torch.randint(6, 512, (n,), generator=g).tolist() for n in (3, 11, 26)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("llama", {"num_key_value_heads": 1}),
        ("gemma3", {}),
        ("gemma2", {}),
        ("phi3", {}),
        ("phi", {}),
        ("stablelm", {}),
        ("starcoder2", {}),
        ("mixtral", {}),
        ("qwen2_moe", {}),
        ("qwen3_moe", {}),
        ("gpt2", {}),
        ("gpt2", {"tie_word_embeddings": False}),
        ("opt", {}),
        ("opt", {"word_embed_proj_dim": 32}),
        ("gpt_neox", {}),
        ("falcon", {}),
        ("falcon", {"num_kv_heads": 1}),
        ("falcon_mqa", {}),
    ],
    ids=[
        "llama", "qwen3", "llama-one-kv-head", "gemma3", "gemma2", "phi3", "phi", "stablelm",
        "starcoder2", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2", "gpt2-untied", "opt",
        "opt-projected", "gpt_neox", "falcon", "falcon-one-kv-head", "falcon_mqa",
    ],
)  # fmt: skip
def test_two_ranks_give_the_tokens_of_one(architecture, overrides, tmp_path):
    """-tp 2 (KV heads split, or the one KV head replicated): transformers' greedy tokens
    and -tp 1's logprobs within 1e-4, prompts chunked over a cached prefix (second pass)
    in a cache small enough to preempt."""
    directory = make_checkpoint(tmp_path / architecture, architecture, **overrides)

    def check(engine: Any, reference: Any) -> None:
        assert len(engine.executor.procs) == 1
        # Rank 0 holds half the attention heads.
        model = engine.loaded.model
        attention = next(m for m in model.modules() if isinstance(m, Attention))
        assert attention.num_heads == reference.config.num_attention_heads // 2
        # One group per process: a second engine waits for the first to shut down.
        with pytest.raises(ConfigError, match="already belongs to a tensor-parallel or pipeline"):
            LLM(str(directory), tensor_parallel_size=2, **SMALL_CACHE)

    assert_parity_with_one_rank(directory, {"tensor_parallel_size": 2}, check)


@pytest.mark.parametrize(
    ("architecture", "fused"), [("mixtral", False), ("qwen2_moe", True), ("qwen3_moe", False)]
)
def test_experts_split_by_expert_over_two_ranks(architecture, fused, tmp_path):
    """--enable-expert-parallel: each rank holds two of the four experts whole (from one
    tensor per expert, or from transformers' fused tensors), the attention and a shared
    expert split by rows as without it; transformers' tokens and -tp 1's logprobs."""
    directory = make_checkpoint(tmp_path / architecture, architecture)
    if fused:
        from safetensors.torch import save_file

        state = load_reference(directory).state_dict()
        (directory / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")

    def check(engine: Any, reference: Any) -> None:
        from pagedllm.core.layers.moe import FusedMoE

        model = engine.loaded.model
        experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
        config = reference.config
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert (experts.num_experts, experts.first_expert, experts.full_experts) == (2, 0, 4)
        assert tuple(experts.gate_up_proj.shape) == (2, 2 * inter, config.hidden_size)
        mlp = model.model.layers[0].mlp
        if getattr(mlp, "shared_expert", None) is not None:
            full = config.shared_expert_intermediate_size
            assert mlp.shared_expert.down_proj.input_size == full // 2

    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    assert_parity_with_one_rank(directory, parallel, check)


def test_expert_parallelism_without_experts_to_split_says_so(tmp_path, caplog):
    """Accepted, as vLLM does, where it changes nothing (one rank, a dense model), with a
    warning that says why."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    for tp, message in ((1, "with one tensor-parallel rank"), (2, "has no mixture-of-experts")):
        caplog.clear()
        options = dict(tensor_parallel_size=tp, enable_expert_parallel=True, **SMALL_CACHE)
        llm = LLM(str(directory), **options)
        try:
            assert len(_generate(llm, _prompts()[:1])[0].outputs[0].token_ids) == NEW_TOKENS
        finally:
            llm.llm_engine.shutdown()
        assert message in caplog.text


def test_the_transformers_backend_over_two_ranks(tmp_path):
    """--model-impl transformers -tp 2: the linear layers the model's own plan names
    split (Q/K/V and gate/up by rows, o and down by columns, Qwen3's Q/K norms whole);
    transformers' tokens and one rank's logprobs."""
    from pagedllm.core.layers.linear import Linear

    directory = make_checkpoint(tmp_path / "qwen3", "qwen3")

    def check(engine: Any, reference: Any) -> None:
        model = engine.loaded.model
        assert model.attn[0].num_heads == reference.config.num_attention_heads // 2
        attention = model.hf.model.layers[0].self_attn
        assert isinstance(attention.q_proj, Linear) and not attention.q_proj.reduce_output
        assert isinstance(attention.o_proj, Linear) and attention.o_proj.reduce_output

    parallel = {"tensor_parallel_size": 2, "model_impl": "transformers"}
    assert_parity_with_one_rank(directory, parallel, check)


def test_ranks_load_their_weights_in_turn(tmp_path):
    """--max-parallel-loading-workers 1: rank 0 and rank 1 load their weights one after
    the other (their loading times do not overlap), then serve as usual."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(directory), tensor_parallel_size=2, max_parallel_loading_workers=1, **SMALL_CACHE)
    try:
        (start0, end0), (start1, end1) = llm.llm_engine.rank_loading
        assert end0 <= start1 or end1 <= start0, llm.llm_engine.rank_loading
        assert len(_generate(llm, _prompts()[:1])[0].outputs[0].token_ids) == NEW_TOKENS
    finally:
        llm.llm_engine.shutdown()


# Chunked prefill over a cached prefix in a cache small enough to preempt.
SMALL_CACHE: dict[str, Any] = dict(
    dtype="float32",
    max_num_batched_tokens=16,
    num_gpu_blocks_override=8,
    block_size=8,
    max_model_len=64,
    disable_log_stats=True,
)


def assert_parity_with_one_rank(
    directory: Any, parallel: dict[str, int], check: Callable[[Any, Any], None]
) -> Any:
    """An engine with ``parallel`` (its ranks' ``check(engine, reference)`` first) gives
    transformers' greedy tokens and one rank's logprobs within 1e-4, twice (the second
    time over cached prefixes), with chunked prefill and preemption; its workers are gone
    after its shutdown. Returns the engine, shut down."""
    reference = load_reference(directory)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    single = _generate(LLM(str(directory), **SMALL_CACHE), prompts)
    llm = LLM(str(directory), **parallel, **SMALL_CACHE)
    engine = llm.llm_engine
    try:
        check(engine, reference)
        for _ in range(2):
            outputs = _generate(llm, prompts)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            for ours, theirs in zip(outputs, single, strict=True):
                for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
                    for token, logprob in b.items():
                        assert abs(a[token].logprob - logprob.logprob) < 1e-4
        assert engine.kv_manager.total_prefix_cache_stats.hits > 0
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()
    assert all(not proc.is_alive() for proc in engine.executor.procs)
    return engine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"distributed_executor_backend": "external_launcher"},
            "external_launcher is not supported by pagedllm yet",
        ),
        ({"distributed_executor_backend": "uni"}, "uni runs one process"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size=0 is invalid"),
        (
            {"max_parallel_loading_workers": 1, "distributed_executor_backend": "ray"},
            "--max-parallel-loading-workers applies to the mp backend",
        ),
        (
            {"max_parallel_loading_workers": 1, "tensor_parallel_size": 1},
            "one process loads alone",
        ),
        (
            {"enable_expert_parallel": True, "data_parallel_size": 2},
            "--enable-expert-parallel with --data-parallel-size above 1 is not supported",
        ),
    ],
)
def test_what_tensor_parallelism_cannot_do_is_refused(kwargs, message):
    args = EngineArgs(model="m", **{"tensor_parallel_size": 2, **kwargs})
    with pytest.raises(ConfigError, match=message):
        args.create_engine_config(make_plugin_manager())


@pytest.mark.parametrize(("architecture", "qtype"), [("llama", "Q4_1"), ("phi3", "Q5_1")])
def test_gguf_weights_split_packed(architecture, qtype, tmp_path):
    """GGUF models over two ranks: packed rows (Phi-3's fused Q/K/V and gate/up parts too)
    and whole blocks of columns split, the packed embedding vocab-parallel;
    transformers' tokens on the stored weights."""
    from gguf import GGMLQuantizationType
    from gguf_writer import gguf_checkpoint

    directory, path, model = gguf_checkpoint(tmp_path, architecture, GGMLQuantizationType[qtype])
    prompts = _prompts()
    expected = [reference_greedy(model, p, NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", tensor_parallel_size=2)
    try:
        loaded = llm.llm_engine.loaded.model
        assert loaded.model.embed_tokens.weight.dtype == torch.uint8
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_pooling_over_two_ranks(parallel, tmp_path):
    """A causal LM's embeddings and a sequence classifier's scores (its ``score`` layer
    whole on every rank; stage 0 applies it to the last stage's hidden states) over two
    ranks equal one rank's; a BERT encoder, which has no stages, is refused by name with
    -pp (with -tp: test_pooling.py)."""
    import transformers
    from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

    directory = tmp_path / "classifier"
    make_classifier(directory)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    llama = make_checkpoint(tmp_path / "llama", "llama")

    def pooled(ranks: int) -> list[Any]:
        # (one engine at a time: a process is a rank of one group)
        options = {"dtype": "float32", "disable_log_stats": True, parallel: ranks}
        classifier = LLM(str(directory), **options)
        try:
            probs = [o.outputs.probs for o in classifier.classify(prompts, use_tqdm=False)]
            rewards = [o.outputs.data for o in classifier.reward(prompts, use_tqdm=False)]
        finally:
            classifier.llm_engine.shutdown()
        embedder = LLM(str(llama), task="embed", **options)
        try:
            embedded = [o.outputs.embedding for o in embedder.embed(prompts, use_tqdm=False)]
        finally:
            embedder.llm_engine.shutdown()
        return [torch.as_tensor(x) for x in (*probs, *rewards, *embedded)]

    for one, two in zip(pooled(1), pooled(2), strict=True):
        assert one.shape == two.shape and torch.allclose(one, two, atol=1e-5)
    if parallel == "tensor_parallel_size":
        return
    bert = tmp_path / "bert"
    make_tokenizer(bert)
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4,
        )
    ).save_pretrained(bert)  # fmt: skip
    with pytest.raises(ConfigError, match="BertModel does not support pipeline parallel"):
        LLM(str(bert), dtype="float32", pipeline_parallel_size=2)


def _worker_pids(server: RemoteServer) -> list[int]:
    assert server.proc is not None
    children = psutil.Process(server.proc.pid).children(recursive=True)
    # (Workers are new interpreters running pagedllm's worker module.)
    worker = "pagedllm.executors.worker_process"
    return [c.pid for c in children if worker in " ".join(c.cmdline())]


@pytest.mark.parametrize(
    ("flag", "worker"), [("-tp", "tensor-parallel worker rank 1"), ("-pp", "pipeline stage 1")]
)
def test_the_server_serves_with_two_ranks_and_dies_with_a_worker(flag, worker, tmp_path):
    """-tp 2 / -pp 2 behind the server: transformers' greedy tokens for a batch of
    prompts; a worker (rank 1, or stage 1) killed makes the server fail and exit."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    reference = load_reference(directory)
    prompts = _prompts()
    server = RemoteServer(directory, flag, "2", log_path=tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready()
        client = server.client()
        completion = client.completions.create(
            model=str(directory), prompt=prompts, max_tokens=NEW_TOKENS, temperature=0,
            logprobs=1, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        for choice in completion.choices:
            ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
            assert ids == reference_greedy(reference, prompts[choice.index], NEW_TOKENS)[0]
            assert choice.finish_reason == "length"
        # A stream cancelled midway (with -pp, its step may be in flight) frees its blocks.
        stream = client.completions.create(
            model=str(directory), prompt=prompts[2], max_tokens=60, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            break
        stream.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            server.metric("pagedllm:kv_cache_usage_perc") != 0
            or server.metric("pagedllm:num_requests_running") != 0
        ):
            time.sleep(0.2)
        assert server.metric("pagedllm:kv_cache_usage_perc") == 0
        assert server.metric("pagedllm:num_requests_running") == 0
        (pid,) = _worker_pids(server)
        psutil.Process(pid).kill()
        with pytest.raises(Exception):  # noqa: B017 (whatever the client makes of it)
            client.completions.create(model=str(directory), prompt=prompts[0], max_tokens=4)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode not in (None, 0), "the server did not fail"
        assert worker in server.log_text()
    finally:
        server.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_ray_actors_as_the_ranks(parallel, tmp_path):
    """--distributed-executor-backend ray: rank 1 (a tensor-parallel rank, or pipeline
    stage 1) is a Ray actor placed by a placement group on a local Ray instance;
    transformers' greedy tokens."""
    pytest.importorskip("ray")
    import ray

    directory = make_checkpoint(tmp_path / "llama", "llama")
    reference = load_reference(directory)
    prompts = _prompts()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        llm = LLM(
            str(directory),
            dtype="float32",
            distributed_executor_backend="ray",
            **{parallel: 2},
            disable_log_stats=True,
        )
        try:
            outputs = _generate(llm, prompts)
            expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
            assert [o.outputs[0].token_ids for o in outputs] == expected
            group = llm.llm_engine.executor.group
            assert len(group.actors) == 1
            assert ray.util.placement_group_table(group.group)["state"] == "CREATED"
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_prompt_logprobs_beams_and_an_fp8_cache_over_two_ranks(parallel, tmp_path):
    """The other row blocks (prompt logprobs: with stages, every prompt row back from the
    last one), the block copies of beam search (each rank's cache) and an fp8 KV cache
    (each rank's scales, of its heads or its layers) give one rank's results; a one-rank
    engine built beside a two-rank one in the same process is built whole."""
    from safetensors.torch import load_file, save_file

    from pagedllm import BeamSearchParams
    from pagedllm.core.layers.weights import HeldElsewhere

    directory = make_checkpoint(tmp_path / "llama", "llama")
    # The checkpoint's own KV-cache scales (every rank must store with them).
    state = load_file(directory / "model.safetensors")
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            state[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(0.02 + 0.01 * layer)
    save_file(state, directory / "model.safetensors")
    prompts = _prompts()[:2]
    kwargs = dict(dtype="float32", kv_cache_dtype="fp8", disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    beams = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)

    def run(llm: LLM) -> tuple[list, list, list]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        searched = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams)
        return (
            [o.outputs[0].token_ids for o in outputs],
            [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]]
             for o in outputs],
            [[s.output_tokens for s in o.sequences] for o in searched],
        )  # fmt: skip

    two = LLM(str(directory), **{parallel: 2}, **kwargs)
    try:
        tokens, prompt_logprobs, searched = run(two)
        single = LLM(str(directory), **kwargs)
        layers = single.llm_engine.loaded.model.model.layers
        assert layers[0].self_attn.num_heads == 4
        assert not any(isinstance(layer, HeldElsewhere) for layer in layers)
        assert layers[1].self_attn.attn.k_scale == pytest.approx(0.03)
        expected_tokens, expected_logprobs, expected_beams = run(single)
    finally:
        two.llm_engine.shutdown()
    assert tokens == expected_tokens and searched == expected_beams
    for ours, theirs in zip(prompt_logprobs, expected_logprobs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_over_two_ranks(parallel, method, tmp_path):
    """Drafts (prompt lookup, or a draft model whole on rank 0: the target itself, so
    every draft is kept) verified by the model over two ranks: the greedy tokens of one
    rank without speculation (prompt lookup in a cache small enough to preempt)."""
    from engine_settings import SPECULATION_PROMPTS as PROMPTS

    directory = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cache = dict(SMALL_CACHE)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    if method == "draft_model":
        config = {"model": str(directory), "num_speculative_tokens": 3}
        cache["num_gpu_blocks_override"] = 64  # (no preemption: every draft is kept)
    expected = LLM(str(directory), **cache).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=config, **{parallel: 2}, **cache)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in expected
        ]
        stats = llm.llm_engine.scheduler.extensions["spec"].stats
        assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
        if method == "draft_model":
            assert stats["accepted_tokens"] == stats["draft_tokens"]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_sharded_state_of_two_ranks(parallel, tmp_path):
    """LLM.save_sharded_state over two ranks: each writes its own part (rank 0's and rank
    1's files), which loads (--load-format sharded_state) with the same sizes and gives
    the same tokens; with other sizes it is refused, naming them."""
    directory = make_checkpoint(tmp_path / "llama", "llama")
    state = tmp_path / "state"

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in _generate(llm, _prompts())]

    llm = LLM(str(directory), **{parallel: 2}, **SMALL_CACHE)
    try:
        expected = tokens(llm)
        llm.save_sharded_state(str(state))
    finally:
        llm.llm_engine.shutdown()
    assert sorted(f.name for f in state.glob("model-rank-*")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]
    options = {"load_format": "sharded_state", **SMALL_CACHE}
    again = LLM(str(state), **{parallel: 2}, **options)
    try:
        assert tokens(again) == expected
    finally:
        again.llm_engine.shutdown()
    with pytest.raises(ConfigError, match="loads with the --tensor-parallel-size and"):
        LLM(str(state), **options)


def test_a_weight_too_small_for_its_shard_is_refused(tmp_path):
    """Only the vocabulary's padding rows are zero-filled; any other tensor too short for
    a rank's range is an error naming it."""
    from pagedllm.core.layers.linear import Linear
    from pagedllm.core.layers.weights import copy_weights
    from pagedllm.distributed import parallel_state

    parallel_state.set_tensor_parallel(1, 2)
    try:
        layer = Linear(8, 16, parallel="column")
    finally:
        parallel_state.set_tensor_parallel(0, 1)
    with pytest.raises(ConfigError, match="'weight' has shape \\(12, 8\\): too small"):
        copy_weights(layer, [("weight", torch.ones(12, 8))])
