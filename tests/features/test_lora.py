"""LoRA adapters (``--enable-lora``): adapters saved by peft run as transformers + peft run
them, token for token, one per prompt in mixed batches (with the base model too); the
batched product against its reference; slots, the CPU cache and the batch's adapter limit;
refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import clean_env
from kernel_checks import skip_unless_build_failed
from openai_server import RemoteServer, assert_openai_error, start_servers
from tiny_models import make_checkpoint, reference_greedy

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.entrypoints.openai.serving_setup import parse_lora_modules
from pagedllm.lora.ops import LoRABatch, add_lora, lora_bgmv, lora_delta_reference

peft = pytest.importorskip("peft")

# (the first two span a full KV block of 16 tokens: the second pass hits the prefix cache)
PROMPTS = [
    [1, 5, 9, 23, 42, 77, 30, 91, 18, 250, 33, 61, 7, 120, 44, 301, 12, 87, 5, 9],
    [1, 7, 7, 7, 33, 100, 12, 64, 8, 19, 2, 55, 140, 3, 66, 202, 18, 9],
]
NEW_TOKENS = 10
TARGETS = [
    ["q_proj", "v_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # (the embedding table and the untied vocabulary head too)
    ["embed_tokens", "lm_head", "o_proj", "down_proj"],
]


def test_grouped_product_matches_the_reference():
    """The grouped GEMMs (an adapter with more tokens than the C kernel takes)."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, 16), torch.randn(3, 24, 4)
    scale = torch.tensor([0.5, 2.0, 1.0])
    x = torch.randn(20, 16)
    slots = torch.tensor([0] * 12 + [-1, -1, 2, 2, 0, 1, 1, -1])
    batch = LoRABatch.from_slots(slots)
    assert not batch.few_tokens
    y = torch.randn(20, 24)
    expected = y + lora_delta_reference(x, slots, a, b, scale)
    torch.testing.assert_close(add_lora(y.clone(), x, batch, a, b, scale), expected)


def test_bgmv_kernel_matches_the_reference():
    """The C kernel for few tokens per adapter (decode steps), against the reference."""
    torch.manual_seed(1)
    a, b = torch.randn(3, 8, 40), torch.randn(3, 24, 8)
    scale = torch.tensor([0.5, 2.0, 1.0])
    x = torch.randn(7, 40)
    slots = torch.tensor([2, -1, 0, 1, 1, -1, 2])
    y = torch.randn(7, 24)
    expected = y + lora_delta_reference(x, slots, a, b, scale)
    if not lora_bgmv(y, x, slots, a, b, scale):
        skip_unless_build_failed()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # add_lora takes it for such steps (and the grouped GEMMs beyond).
    batch = LoRABatch.from_slots(slots)
    assert batch.few_tokens
    again = add_lora(y - lora_delta_reference(x, slots, a, b, scale), x, batch, a, b, scale)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 (biases on Q/K/V) and three peft adapters of ranks 4, 8, 4 with
    random (non-zero) A and B, each with its transformers + peft model."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = make_checkpoint(root / "base", "qwen2", seed=1)
    adapters = []
    for i, targets in enumerate(TARGETS):
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        rank = 8 if i == 1 else 4
        config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=targets)
        model = peft.get_peft_model(base, config)
        torch.manual_seed(10 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.3)
        model.save_pretrained(root / f"adapter{i}")
        adapters.append(
            (LoRARequest(f"adapter{i}", i + 1, str(root / f"adapter{i}")), model.eval())
        )
    reference = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return base_dir, adapters, reference.eval()


def _llm(base_dir: Path, **kwargs) -> LLM:
    return LLM(str(base_dir), dtype="float32", disable_log_stats=True, enable_lora=True, **kwargs)


def _check(llm, prompts, loras, models_for_prompts) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=1
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    for prompt, output, model in zip(prompts, outputs, models_for_prompts, strict=True):
        tokens, top = reference_greedy(model, prompt, NEW_TOKENS, num_logprobs=1)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for step, token in enumerate(tokens):
            assert abs(completion.logprobs[step][token].logprob - top[step][token]) < 1e-3


def test_mixed_batches_equal_peft(models):
    """One batch: each prompt with another adapter (or none), the same prompt with and
    without one (the prefix cache keeps them apart)."""
    base_dir, adapters, reference = models
    llm = _llm(base_dir, max_loras=3, max_lora_rank=8)
    (r0, m0), (r1, m1), (r2, m2) = adapters
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    _check(llm, prompts, [r0, r1, None, r0, r2], [m0, m1, reference, m0, m2])
    # Again: the prompts hit the prefix cache, each under its own adapter.
    _check(llm, prompts, [r0, r1, None, r0, r2], [m0, m1, reference, m0, m2])
    engine = llm.llm_engine
    assert engine.kv_manager.total_prefix_cache_stats.hits > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_lora_dtype_takes_a_torch_dtype(models):
    """``lora_dtype=torch.float16`` (vLLM's type for it) is ``"float16"``: the slots hold
    float16 weights, which a float32 model computes with (peft's greedy tokens)."""
    base_dir, adapters, _ = models
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for lora_dtype in (torch.float16, "float16"):
        llm = _llm(base_dir, max_lora_rank=8, lora_dtype=lora_dtype)
        manager = llm.llm_engine.extensions["lora"].manager
        slots = manager.layers["model.layers.0.mlp.down_proj"].lora
        assert slots.a.dtype == slots.b.dtype == torch.float16
        for request, model in adapters:
            prompt = {"prompt_token_ids": PROMPTS[0]}
            output = llm.generate(prompt, params, lora_request=request, use_tqdm=False)
            expected = reference_greedy(model, PROMPTS[0], NEW_TOKENS)[0]
            assert output[0].outputs[0].token_ids == expected


def test_slots_and_cache_are_bounded(models):
    """One slot and two cached adapters for three adapters: a batch holds one adapter at
    a time (the others wait), slots and cache entries are reused, results unchanged."""
    base_dir, adapters, reference = models
    llm = _llm(base_dir, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    (r0, m0), (r1, m1), (r2, m2) = adapters
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    _check(llm, prompts, [r0, r1, r2, None], [m0, m1, m2, reference])
    manager = llm.llm_engine.extensions["lora"].manager
    assert len(manager.cpu) <= 2 and len(manager.slots) == 1
    _check(llm, [PROMPTS[1]], [r0], [m0])  # (evicted earlier: loaded again)
    # LLM.chat passes the adapter on too.
    chat = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (output,) = llm.chat(chat, params, lora_request=r1, use_tqdm=False)
    expected = reference_greedy(m1, output.prompt_token_ids, 4)[0]
    tokens = output.outputs[0].token_ids  # (up to EOS)
    assert tokens == expected[: len(tokens)]


def test_an_admitted_request_keeps_its_adapter(models, tmp_path):
    """One slot and one cached adapter for three requests with three adapters admitted
    at once, whose files are then deleted: no adapter a request waits for is evicted, so
    each request runs the adapter read when it came (transformers + peft's tokens)."""
    base_dir, adapters, _ = models
    engine = _llm(base_dir, max_loras=1, max_lora_rank=8, max_cpu_loras=1).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    copies = []
    for i, (request, _) in enumerate(adapters):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(request.lora_path, copy)
        copies.append(LoRARequest(f"copy{i}", 10 + i, str(copy)))
        engine.add_request(
            f"r{i}", {"prompt_token_ids": PROMPTS[i % 2]}, params, lora_request=copies[-1]
        )
    for copy in copies:
        shutil.rmtree(copy.lora_path)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    for i, (_, model) in enumerate(adapters):
        assert tokens[f"r{i}"] == reference_greedy(model, PROMPTS[i % 2], NEW_TOKENS)[0]


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_adapters_over_two_ranks(models, parallel):
    """-tp 2: each rank holds its share of every adapter (B's rows of column-parallel
    layers and of the head's vocabulary, A's columns of row-parallel ones, the
    embedding's whole); -pp 2: each stage its layers' adapters (rank 0 checks adapters
    against every stage's layers). The tokens of transformers + peft in mixed batches
    (over micro-batches with -pp), with slots refilled (rank 0 sends the other rank the
    adapters it fills them with) and an id that names another adapter once its first is
    removed."""
    base_dir, adapters, reference = models
    llm = _llm(base_dir, max_loras=2, max_lora_rank=8, max_cpu_loras=2, **{parallel: 2})
    try:
        (r0, m0), (r1, m1), (r2, m2) = adapters
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
        _check(llm, prompts, [r0, r1, r2, None], [m0, m1, m2, reference])
        manager = llm.llm_engine.extensions["lora"].manager
        first, last = "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
        if parallel == "tensor_parallel_size":
            inter = reference.config.intermediate_size
            assert manager.layers[first].lora.a.shape[-1] == inter // 2
        else:
            assert first in manager.layers and last not in manager.layers
            assert manager.sizes[last] == manager.sizes[first]
            # (LoRA does not allow steps in flight: its slots serve one step at a time)
            assert llm.llm_engine.step_queue is None
        manager.adapter(r0)  # (loaded again if the cache let it go)
        assert manager.remove(r0.lora_int_id)
        renamed = LoRARequest("renamed", r0.lora_int_id, r2.lora_path)
        _check(llm, [PROMPTS[1], PROMPTS[0]], [renamed, r1], [m2, m1])
    finally:
        llm.llm_engine.shutdown()


def test_refusals(models, tmp_path):
    base_dir, adapters, _ = models
    request = adapters[1][0]
    plain = LLM(str(base_dir), dtype="float32", disable_log_stats=True)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=request)
    llm = _llm(base_dir, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="max-lora-rank"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=request)
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with pytest.raises(InvalidRequestError, match="missing"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=missing)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("bad", 0, "x")
    # The engine goes on serving.
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0].outputs[0].token_ids


def test_lora_modules_spellings():
    """The seeds' forms: name=path, JSON with path (004) or local_path (002)."""
    assert parse_lora_modules(
        [
            "a=/x",
            '{"name": "b", "path": "/y", "base_model_name": "base"}',
            '{"name": "c", "local_path": "/z", "base_model_name": "base"}',
            '{"name": "d", "local_path": "/w", "path": "/w"}',
        ]
    ) == [("a", "/x", None), ("b", "/y", "base"), ("c", "/z", "base"), ("d", "/w", None)]
    for entry, message in [
        ('{"name": "c", "local_path": "/z", "path": "/y"}', "'path' and 'local_path'"),
        ('{"local_path": "/z"}', "needs 'name' and 'path' .or 'local_path'."),
        ('{"name": "c", "local_path": 3}', "needs 'name'"),
        ('{"name": "c", "path": "/z", "bogus": 1}', r"unknown \['bogus'\]"),
        ("[1]", "use name=path or a JSON object"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_lora_modules([entry])


def test_server_adapters(models, tmp_path):
    """--lora-modules (both spellings): the adapters are models in /v1/models and a
    request names one; with PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING adapters are loaded and
    unloaded at run time."""
    base_dir, adapters, reference = models
    (r0, m0), (r1, m1), (r2, m2) = adapters
    spec = json.dumps({"name": "second", "path": r1.lora_path, "base_model_name": "base"})
    older = json.dumps({"name": "fourth", "local_path": r2.lora_path, "base_model_name": "base"})
    server = RemoteServer(
        base_dir, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
        "--max-lora-rank", "8", "--lora-modules", f"first={r0.lora_path}", spec, older,
        log_path=tmp_path / "s.log",
        env=clean_env(PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING="True"),
    )  # fmt: skip
    start_servers(server)
    try:
        with server.http() as http:
            models_list = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert set(models_list) == {"base", "first", "second", "fourth"}
            assert models_list["second"]["parent"] == "base"
            assert models_list["first"]["root"] == r0.lora_path

            def tokens(model: str) -> list[int]:
                body = {"model": model, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS,
                        "temperature": 0, "min_tokens": NEW_TOKENS, "logprobs": 0}  # fmt: skip
                reply = http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0]["logprobs"]["tokens"]

            tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)

            def expected(model) -> list[str]:
                ids = reference_greedy(model, PROMPTS[0], NEW_TOKENS)[0]
                return [tokenizer.decode([i]) for i in ids]

            assert tokens("first") == expected(m0)
            assert tokens("second") == expected(m1)
            assert tokens("base") == expected(reference)
            assert tokens("fourth") == expected(m2)  # (given with seed 002's local_path)
            load = {"lora_name": "third", "lora_path": r2.lora_path}
            assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
            assert tokens("third") == expected(m2)
            assert_openai_error(http.post("/v1/load_lora_adapter", json=load), 400, "already")
            unload = {"lora_name": "first"}
            assert http.post("/v1/unload_lora_adapter", json=unload).status_code == 200
            assert_openai_error(
                http.post("/v1/completions", json={"model": "first", "prompt": "x"}), 404
            )
            assert_openai_error(http.post("/v1/unload_lora_adapter", json=unload), 404)
    finally:
        server.stop()
