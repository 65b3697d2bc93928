"""Speculative decoding (``--speculative-config``): greedy outputs identical to no
speculation (with prefix caching, chunked prefill and preemption), sampled outputs
distributed as the target model's (a chi-square test against transformers' exact
probabilities), the batch-size cut-off, the metrics, and the refusals."""

from __future__ import annotations

import pytest
import torch
import transformers
from engine_settings import SETTINGS
from engine_settings import SPECULATION_PROMPTS as PROMPTS
from openai_server import RemoteServer, start_servers
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.core.spec_decode import NgramProposer, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("spec") / "qwen2", "qwen2", seed=1)


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ngram_proposer():
    proposer = NgramProposer(SpeculativeConfig.from_dict(NGRAM))
    assert proposer.lookup([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # [2, 3] seen before
    assert proposer.lookup([1, 2, 3, 1, 2, 5, 1, 2], 2) == [5, 1]  # the latest match
    assert proposer.lookup([1, 2, 3, 4], 2) == []
    assert proposer.lookup([7, 7], 3) == [7]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_outputs_are_unchanged(checkpoint, setting):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kwargs = dict(dtype="float32", disable_log_stats=True, **SETTINGS[setting])
    expected = _tokens(LLM(str(checkpoint), **kwargs), params)
    llm = LLM(str(checkpoint), speculative_config=NGRAM, **kwargs)
    assert _tokens(llm, params) == expected
    stats = llm.llm_engine.scheduler.extensions["spec"].stats
    assert stats["draft_tokens"] > 0 and 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    if setting == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    engine = llm.llm_engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_outputs_keep_the_target_distribution(checkpoint, method):
    """600 seeded samples (temperature 0.5, top-5) with prompt lookup proposing: the
    distribution of their first two tokens (the second one verified against a draft)
    against the exact probabilities of the 25 outcomes, computed with transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    temperature = 0.5

    def top5(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        values, tokens = logits.topk(5)
        probs = (values / temperature).softmax(-1)
        return dict(zip(tokens.tolist(), probs.tolist(), strict=True))

    # [a, b, c, a] with [a, b, c] the model's greedy run from a, for an ``a`` where the
    # model goes on with b, c: after a first token b, prompt lookup proposes c, which
    # the target keeps or rejects (both happen).
    for a in range(6, 512):
        start = model.generate(torch.tensor([[a]]), max_new_tokens=2, do_sample=False)[0]
        prompt = [*start.tolist(), a]
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)[0]
        if greedy.tolist()[len(prompt) :] == prompt[1:3]:
            break
    exact = {}
    for first, p1 in top5(prompt).items():
        for second, p2 in top5([*prompt, first]).items():
            exact[(first, second)] = p1 * p2
    # (the draft model is the target itself: its greedy drafts are kept with p(argmax))
    config = NGRAM if method == "ngram" else {"model": str(checkpoint), "num_speculative_tokens": 2}
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True, speculative_config=config)
    n = 600
    params = [
        SamplingParams(temperature=temperature, top_k=5, max_tokens=3, ignore_eos=True, seed=i)
        for i in range(n)
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts: dict[tuple[int, int], int] = {}
    for output in outputs:
        key = tuple(output.outputs[0].token_ids[:2])
        assert key in exact, key
        counts[key] = counts.get(key, 0) + 1
    stats = llm.llm_engine.scheduler.extensions["spec"].stats
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    # Chi-square over the outcomes expected at least 5 times (the rest pooled).
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for key, probability in exact.items():
        if probability * n >= 5:
            observed.append(counts.get(key, 0))
            expected.append(probability * n)
        else:
            rest_o += counts.get(key, 0)
            rest_e += probability * n
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    # 0.1% critical values of chi-square by degrees of freedom (at most 25 cells).
    critical = [
        10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3, 32.9, 34.5,
        36.1, 37.7, 39.3, 40.8, 42.3, 43.8, 45.3, 46.8, 48.3, 49.7, 51.2, 52.6,
    ]  # fmt: skip
    assert chi2 < critical[len(observed) - 2], (chi2, observed, expected)


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("draft") / "qwen2", "qwen2", seed=2)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_draft_model_greedy_outputs_are_unchanged(checkpoint, other_checkpoint, setting):
    """A draft model: the target itself (every draft kept: the draft KV bookkeeping is
    right) and another model (drafts rejected); the outputs are the target's either way."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", disable_log_stats=True, **SETTINGS[setting])
    expected = _tokens(LLM(str(checkpoint), **kwargs), params)
    for draft in (checkpoint, other_checkpoint):
        config = {"model": str(draft), "num_speculative_tokens": 3}
        llm = LLM(str(checkpoint), speculative_config=config, **kwargs)
        assert _tokens(llm, params) == expected
        stats = llm.llm_engine.scheduler.extensions["spec"].stats
        assert stats["draft_tokens"] > 0
        if draft == checkpoint and setting != "preemption":
            assert stats["accepted_tokens"] == stats["draft_tokens"]
        if setting == "preemption":
            assert llm.llm_engine.scheduler.num_preemptions > 0


def test_disable_by_batch_size(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = {**NGRAM, "disable_by_batch_size": 1}
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True, speculative_config=config)
    _tokens(llm, params)  # every step has a running request: never speculates
    assert llm.llm_engine.scheduler.extensions["spec"].stats["draft_tokens"] == 0


def test_max_model_len_stops_speculating_long_sequences(checkpoint):
    """``max_model_len``: the long prompt (40 tokens) decodes without drafts, the short
    ones (11) speculate; the outputs are plain greedy's either way."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kwargs = dict(dtype="float32", disable_log_stats=True)
    expected = _tokens(LLM(str(checkpoint), **kwargs), params)
    config = {**NGRAM, "max_model_len": 30}
    llm = LLM(str(checkpoint), speculative_config=config, **kwargs)
    assert _tokens(llm, params) == expected
    stats = llm.llm_engine.scheduler.extensions["spec"].stats
    long_prompt = {"prompt_token_ids": PROMPTS[3]}
    before = dict(stats)
    assert llm.generate(long_prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected[3]
    assert stats == before  # (nothing proposed for it)
    short = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in llm.generate(short, params, use_tqdm=False)] == (
        expected[:2]
    )
    assert stats["draft_tokens"] > before["draft_tokens"]


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """The target's weights with a 16-token context."""
    directory = tmp_path_factory.mktemp("short") / "qwen2"
    return make_checkpoint(directory, "qwen2", seed=1, max_position_embeddings=16)


@pytest.mark.parametrize("limit", [15, 16, "draft's context"])
def test_max_model_len_follows_vllms_rule(checkpoint, short_draft, limit):
    """vLLM's rule: a sequence is speculated while its length plus the k drafts is under
    max_model_len (given, or the draft model's context when shorter than the target's).
    The draft model has the target's weights, so each proposal proposes k = 3 and keeps
    them all: after the 11-token prompt and its first token (length 12), 12 + 3 < 16
    speculates once (length 16: no more), 12 + 3 < 15 never."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(dtype="float32", disable_log_stats=True)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    expected = LLM(str(checkpoint), **kwargs).generate(prompt, params, use_tqdm=False)
    if isinstance(limit, int):
        config = {"model": str(checkpoint), "num_speculative_tokens": 3, "max_model_len": limit}
    else:
        config = {"model": str(short_draft), "num_speculative_tokens": 3}
    llm = LLM(str(checkpoint), speculative_config=config, **kwargs)
    output = llm.generate(prompt, params, use_tqdm=False)
    assert output[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    stats = llm.llm_engine.scheduler.extensions["spec"].stats
    assert stats["draft_tokens"] == (0 if limit == 15 else 3)
    assert stats["accepted_tokens"] == stats["draft_tokens"]


def test_max_model_len_larger_than_a_context_is_refused(checkpoint, short_draft):
    config = {**NGRAM, "max_model_len": 65}
    with pytest.raises(ConfigError, match="max_model_len 65 is larger than the target's"):
        LLM(str(checkpoint), max_model_len=64, speculative_config=config)
    config = {"model": str(short_draft), "num_speculative_tokens": 3, "max_model_len": 17}
    with pytest.raises(ConfigError, match="larger than the draft model's context .16 tokens"):
        LLM(str(checkpoint), speculative_config=config)


def test_requests_that_cannot_be_verified_decode_as_usual(checkpoint):
    """Logprobs, penalties: no drafts for them, and the same output."""
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, repetition_penalty=1.2)
    expected = _tokens(LLM(str(checkpoint), dtype="float32", disable_log_stats=True), params)
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True, speculative_config=NGRAM)
    assert _tokens(llm, params) == expected
    assert llm.llm_engine.scheduler.extensions["spec"].stats["draft_tokens"] == 0


def test_bad_configs():
    for config, message in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({**NGRAM, "bogus": 1}, "bogus"),
        ({**NGRAM, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({**NGRAM, "max_model_len": 0}, "max_model_len must be a positive integer"),
        ({**NGRAM, "prompt_lookup_max": "4"}, "prompt_lookup_max must be an integer"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_min must be between"),
    ]:
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.from_dict(config)


def test_null_ngram_keys_take_the_defaults():
    config = SpeculativeConfig.from_dict(
        {**NGRAM, "prompt_lookup_max": None, "prompt_lookup_min": None}
    )
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (5, 1)


def test_metrics(checkpoint, tmp_path):
    server = RemoteServer(
        checkpoint, "--dtype", "float32", "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}', log_path=tmp_path / "s.log",
    )  # fmt: skip
    start_servers(server)
    try:
        with server.http() as http:
            body = {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
        drafted = server.metric("pagedllm:spec_decode_num_draft_tokens_total")
        accepted = server.metric("pagedllm:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted
        assert server.metric("pagedllm:spec_decode_num_drafts_total") > 0
    finally:
        server.stop()
