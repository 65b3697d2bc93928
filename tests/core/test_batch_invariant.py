"""``--batch-invariant`` (issue 36, item 7): a request's tokens and logprobs are bit-identical
whether it runs alone or among other requests of other lengths, through ``LLM.generate`` and
through the server with concurrent requests; products, attention (prompts chunked any way)
and sampling included. Without the mode the same runs differ (the control tests), so the
checks can fail. Configurations the mode cannot serve are refused at start-up."""

from __future__ import annotations

import concurrent.futures
import types

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq
from gguf_writer import gguf_checkpoint
from openai_server import RemoteServer
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.attention.layer import Attention
from pagedllm.core.batch_invariance import ENV_BATCH_INVARIANT, batch_invariant_setting
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.kernels.batch_invariant import batch_invariant_mode, linear, unavailable_reason
from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.kernels.gguf_matmul import gguf_linear
from pagedllm.plugins.devices.cpu_attention import KERNEL_MAX_QUERY, CpuPagedBackend

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"batch-invariant mode: {unavailable_reason()}"
)

# A Llama with heads of 64 (the bfloat16 attention kernel's dot-product path, as the
# default model's) and room for prompts longer than the kernel's chunk of SDPA.
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
)
NEW_TOKENS = 12


def _ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(6, 500, (length,), generator=generator).tolist()


# The requests compared: short, medium, and longer than KERNEL_MAX_QUERY (alone it is one
# step of 300 tokens; among others it is chunked by the shared token budget).
TARGETS = [_ids(1, 5), _ids(2, 41), _ids(3, 300)]
# The other requests of the mixed batch: other lengths and output lengths.
FILLERS = [_ids(100 + i, 3 + (37 * i) % 230) for i in range(24)]


def _target_params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)
    # (a seeded sampled request draws from its own generator: reproducible too)
    seeded = SamplingParams(
        temperature=1.0, seed=7, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True
    )
    with_prompt = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    return [greedy, seeded, with_prompt]


def _filler_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4 + (7 * i) % 29, ignore_eos=True)


def _result(output) -> tuple:
    """Everything compared, exactly: tokens, text, each step's logprobs (chosen and top)
    and ranks, and prompt logprobs."""
    completion = output.outputs[0]
    steps = [
        sorted((token, entry.logprob, entry.rank) for token, entry in step.items())
        for step in completion.logprobs
    ]
    prompt = [
        None if step is None else sorted((t, e.logprob) for t, e in step.items())
        for step in (output.prompt_logprobs or [])
    ]
    return list(completion.token_ids), completion.text, steps, prompt


def _alone_and_mixed(llm: LLM) -> tuple[list[tuple], list[tuple]]:
    targets = [{"prompt_token_ids": ids} for ids in TARGETS]
    params = _target_params()
    alone = [
        _result(llm.generate([target], one, use_tqdm=False)[0])
        for target, one in zip(targets, params, strict=True)
    ]
    prompts = [{"prompt_token_ids": ids} for ids in FILLERS[:9]]
    prompts += targets[:1] + [{"prompt_token_ids": ids} for ids in FILLERS[9:17]]
    prompts += targets[1:2] + [{"prompt_token_ids": ids} for ids in FILLERS[17:]] + targets[2:]
    filler_params = [_filler_params(i) for i in range(len(FILLERS))]
    all_params = [*filler_params[:9], params[0], *filler_params[9:17], params[1]]
    all_params += [*filler_params[17:], params[2]]
    outputs = llm.generate(prompts, all_params, use_tqdm=False)
    by_prompt = {tuple(o.prompt_token_ids): o for o in outputs}
    mixed = [_result(by_prompt[tuple(ids)]) for ids in TARGETS]
    return alone, mixed


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A tiny Llama as a Q4_1 GGUF file (the default model's type) and its tokenizer."""
    directory, path, _ = gguf_checkpoint(
        tmp_path_factory.mktemp("bi_gguf"), "llama", GGMLQuantizationType.Q4_1, **CONFIG
    )
    return directory, path


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bi_dense"), "llama", **CONFIG)


def _gguf_llm(gguf_model, dtype: str, **kwargs) -> LLM:
    directory, path = gguf_model
    return LLM(
        str(path),
        tokenizer=str(directory),
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=256,
        disable_log_stats=True,
        **kwargs,
    )


# ------------------------------------------------------------------------ LLM.generate


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_requests_alone_and_in_a_mixed_batch_are_bit_identical(gguf_model, dtype):
    llm = _gguf_llm(gguf_model, dtype, batch_invariant=True)
    assert llm.llm_engine.config.model_config.batch_invariant
    alone, mixed = _alone_and_mixed(llm)
    for index, (one, among) in enumerate(zip(alone, mixed, strict=True)):
        assert one == among, f"target {index}"
    assert all(len(result[0]) == NEW_TOKENS for result in alone)


def test_without_the_mode_the_same_runs_differ(gguf_model):
    """The control: the same engine and runs without --batch-invariant give other bits
    for some target (float32 GGUF products take other kernels at 1, up to 8, and more
    rows; the long prompt alone goes to SDPA, among others to the kernel)."""
    llm = _gguf_llm(gguf_model, "float32")
    alone, mixed = _alone_and_mixed(llm)
    assert alone != mixed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unquantized_requests_alone_and_in_a_mixed_batch_are_bit_identical(dense_model, dtype):
    llm = LLM(
        str(dense_model),
        dtype=dtype,
        batch_invariant=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=256,
        disable_log_stats=True,
    )
    alone, mixed = _alone_and_mixed(llm)
    assert alone == mixed


def test_gptq_requests_alone_and_in_a_mixed_batch_are_bit_identical(dense_model, tmp_path):
    """GPTQ with act-order (columns reordered, repacked as GGML blocks): the same."""
    from int4_writer import _write

    target = tmp_path / "gptq"
    _write(dense_model, target, "gptq", 64, False, True)
    llm = LLM(
        str(target),
        dtype="float32",
        batch_invariant=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=256,
        disable_log_stats=True,
    )
    down = llm.llm_engine.loaded.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.uint8 and down.int4_perm is not None
    alone, mixed = _alone_and_mixed(llm)
    assert alone == mixed


def test_prefix_cached_blocks_give_the_same_bits(gguf_model):
    """With prefix caching (the default), a prompt whose blocks another request computed
    reads their keys and values: in this mode, the same as its own."""
    directory, path = gguf_model
    llm = LLM(str(path), tokenizer=str(directory), dtype="bfloat16", batch_invariant=True)
    params = _target_params()[0]
    prompt = {"prompt_token_ids": TARGETS[2]}
    first = _result(llm.generate([prompt], params, use_tqdm=False)[0])
    shared = {"prompt_token_ids": TARGETS[2][:200] + _ids(9, 50)}
    outputs = llm.generate([shared, prompt], [params, params], use_tqdm=False)
    assert _result(outputs[1]) == first


# ----------------------------------------------------------------------------- server


def test_server_concurrent_requests_match_single_requests(gguf_model, tmp_path):
    """Each target sent alone, then all at once beside the others (float32, where the
    products' kernels change with the row count: without the mode the runs differ)."""
    directory, path = gguf_model
    server = RemoteServer(
        path,
        "--tokenizer",
        str(directory),
        "--batch-invariant",
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        "512",
        base_args=("--dtype", "float32", "--num-gpu-blocks-override", "256"),
        log_path=tmp_path / "server.log",
    )
    server.start().wait_ready()
    try:
        with server.http() as http:

            def complete(ids: list[int], max_tokens: int, logprobs: int | None = 3) -> dict:
                body = {
                    "model": str(path),
                    "prompt": ids,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                if logprobs is not None:
                    body["logprobs"] = logprobs
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                return {"text": choice["text"], "logprobs": choice["logprobs"]}

            alone = [complete(ids, NEW_TOKENS) for ids in TARGETS]
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(FILLERS) + 3) as pool:
                others = [
                    pool.submit(complete, ids, 4 + (7 * i) % 29, None)
                    for i, ids in enumerate(FILLERS)
                ]
                mixed = [pool.submit(complete, ids, NEW_TOKENS) for ids in TARGETS]
                for future in others:
                    future.result()
                mixed = [future.result() for future in mixed]
    finally:
        server.stop()
    assert alone == mixed
    assert all(len(result["logprobs"]["tokens"]) == NEW_TOKENS for result in alone)


# ---------------------------------------------------------------------------- kernels


def test_products_give_each_row_the_same_bits_at_any_row_count():
    """In the mode, rows 5..5+m of a product are those of the full batch, for every m,
    for packed GGUF weights (fused types and another) and dense ones."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(48, 256, generator=generator)
    weights = torch.randn(96, 256, generator=generator)
    products = {"dense": lambda x: linear(x, weights.to(x.dtype))}
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_1"):
        kind = GGMLQuantizationType[qtype]
        packed = torch.from_numpy(gq.quantize(weights.numpy(), kind)).view(torch.uint8)

        def product(x, packed=packed.reshape(96, -1), kind=kind):
            return gguf_linear(x, packed, kind, 96, 256)

        products[qtype] = product
    for name, product in products.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = rows.to(dtype)
            with batch_invariant_mode():
                full = product(x)
                for m in (1, 2, 3, 8, 13, 40):
                    assert torch.equal(product(x[5 : 5 + m].clone()), full[5 : 5 + m]), (
                        name,
                        dtype,
                        m,
                    )


def _cpu_step(backend, layer, caches, block_size, requests):
    """One attention step of ``requests`` (query, key, value, first position, blocks):
    each request's output rows."""
    queries = torch.cat([r[0] for r in requests])
    keys = torch.cat([r[1] for r in requests])
    values = torch.cat([r[2] for r in requests])
    lens = [r[0].shape[0] for r in requests]
    metadata = backend.build_metadata(
        lens,
        [r[3] + n for r, n in zip(requests, lens, strict=True)],
        [r[4] for r in requests],
        block_size,
        caches,
        torch.device("cpu"),
    )
    out = backend.forward(layer, queries, keys, values, metadata)
    return list(out.split(lens))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_prompt_ignores_its_chunks_and_neighbours(cache_dtype):
    """A 300-token prompt attended in one step (alone) and in chunks of 37, 100 and 163
    beside other requests, then one decode alone and among many: the same bits in
    the mode; without it the one-step prompt goes to SDPA (more than KERNEL_MAX_QUERY)."""
    ops = cpu_ops()
    assert ops is not None
    if cache_dtype == torch.bfloat16 and not ops.bf16_cache_ok(64):
        pytest.skip("no bfloat16 cache in this CPU's attention kernel")
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads, 0)
    backend = CpuPagedBackend()
    generator = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32

    def tokens(n):
        return tuple(
            torch.randn(n, size, generator=generator).to(dtype)
            for size in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        )

    length = 300
    assert length > KERNEL_MAX_QUERY
    q, k, v = tokens(length + 1)
    blocks = list(range(64, 64 + 19))
    neighbours = [(tokens(n), list(range(20 * i, 20 * i + 19))) for i, n in enumerate((7, 1, 29))]
    # (enough decodes that the bfloat16 path takes whole tokens as work items, 4 per
    # thread, where one decode alone takes (token, KV head) items)
    crowd_size = 4 * torch.get_num_threads() + 1
    decoders = [(tokens(1), list(range(100 + 4 * i, 104 + 4 * i))) for i in range(crowd_size)]

    def new_cache():
        blocks = 100 + 4 * crowd_size
        return [torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)]

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        caches = new_cache()
        whole = _cpu_step(backend, layer, caches, block_size, [(q[:-1], k[:-1], v[:-1], 0, blocks)])
        decode_alone = _cpu_step(
            backend, layer, caches, block_size, [(q[-1:], k[-1:], v[-1:], length, blocks)]
        )[0]
        caches = new_cache()
        pieces = []
        for start, stop in ((0, 37), (37, 137), (137, length)):
            request = (q[start:stop], k[start:stop], v[start:stop], start, blocks)
            others = [(*t, 0, b) for t, b in neighbours]
            pieces.append(_cpu_step(backend, layer, caches, block_size, [*others, request])[-1])
        crowd = [(*t, 40, b) for t, b in decoders]
        decode_among = _cpu_step(
            backend, layer, caches, block_size, [*crowd, (q[-1:], k[-1:], v[-1:], length, blocks)]
        )[-1]
        return whole[0], torch.cat(pieces), decode_alone, decode_among

    with batch_invariant_mode():
        whole, pieces, decode_alone, decode_among = run()
    assert torch.equal(whole, pieces)
    assert torch.equal(decode_alone, decode_among)
    whole, pieces, _, _ = run()  # (the control)
    assert not torch.equal(whole, pieces)


# --------------------------------------------------------------- options and refusals


def test_the_option_and_the_environment_variables(pm):
    assert not EngineArgs().create_engine_config(pm).model_config.batch_invariant
    assert EngineArgs(batch_invariant=True).create_engine_config(pm).model_config.batch_invariant
    args = EngineArgs()
    assert ENV_BATCH_INVARIANT == ("PAGEDLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")
    assert batch_invariant_setting(args, {"VLLM_BATCH_INVARIANT": "1"})
    assert batch_invariant_setting(args, {"PAGEDLLM_BATCH_INVARIANT": "1"})
    assert not batch_invariant_setting(args, {"VLLM_BATCH_INVARIANT": "0"})
    # (pagedllm's own name first)
    both = {"PAGEDLLM_BATCH_INVARIANT": "0", "VLLM_BATCH_INVARIANT": "1"}
    assert not batch_invariant_setting(args, both)
    assert batch_invariant_setting(EngineArgs(batch_invariant=True), {"VLLM_BATCH_INVARIANT": "0"})
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT='yes please'"):
        batch_invariant_setting(args, {"VLLM_BATCH_INVARIANT": "yes please"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(enable_lora=True), "--enable-lora"),
        (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculat"),
        (dict(compilation_config=3), "compilation level 3"),
    ],
)
def test_options_the_mode_cannot_serve_are_refused_by_name(pm, options, message):
    with pytest.raises(ConfigError, match="--batch-invariant") as excinfo:
        EngineArgs(batch_invariant=True, **options).create_engine_config(pm)
    assert message in str(excinfo.value)


def test_a_model_the_mode_cannot_serve_is_refused_at_start(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "opt", "opt")
    with pytest.raises(ConfigError, match="--batch-invariant: OPTForCausalLM does not"):
        LLM(str(checkpoint), dtype="float32", batch_invariant=True, num_gpu_blocks_override=16)


def test_an_attention_backend_without_the_promise_is_refused(monkeypatch, dense_model):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch_sdpa")
    with pytest.raises(ConfigError, match="--batch-invariant: the torch_sdpa attention"):
        LLM(str(dense_model), dtype="float32", batch_invariant=True, num_gpu_blocks_override=16)


def test_the_cpu_backend_refuses_what_its_kernel_does_not_compute():
    backend = CpuPagedBackend()

    def layer(**changes):
        fields = dict(num_heads=4, num_kv_heads=2, head_dim=64, logits_soft_cap=None)
        return types.SimpleNamespace(**{**fields, **changes})

    assert backend.batch_invariant_refusal([layer()], torch.float32) is None
    # (soft-capped scores are the kernel's too)
    assert backend.batch_invariant_refusal([layer(logits_soft_cap=30.0)], torch.float32) is None
    wide = backend.batch_invariant_refusal([layer(head_dim=1024)], torch.float32)
    assert "head sizes up to 512" in wide
    fp8 = backend.batch_invariant_refusal([layer()], torch.float8_e4m3fn)
    assert "float8" in fp8
