"""Sampler behaviour, checked statistically with fixed seeds, and SamplingParams checks."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedllm.core.request import Request
from pagedllm.core.sampling import (
    RequestOutputKind,
    Sampler,
    SamplingMetadata,
    SamplingParams,
    SamplingType,
    compute_prompt_logprobs,
)
from pagedllm.core.sampling.sampler import (
    _apply_top_k_then_top_p,
    _apply_top_k_top_p,
    apply_logits_processing,
)

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def make_request(
    params: SamplingParams,
    prompt: tuple[int, ...] = (7,),
    output: tuple[int, ...] = (),
    eos: int | None = None,
    request_id: str = "r",
) -> Request:
    request = Request(request_id, list(prompt), params, eos_token_id=eos)
    request.append_output_token_ids(list(output))
    return request


def sample_rows(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    metadata = SamplingMetadata.from_requests(requests, logits.shape[-1], "cpu")
    return Sampler()(logits.clone(), metadata).sampled_token_ids


def draw(
    params: SamplingParams, num: int = 4000, logits: torch.Tensor = LOGITS, **request_kw
) -> Counter[int]:
    """``num`` samples of one logit row: one call with the row repeated ``num`` times."""
    requests = [make_request(params, **request_kw) for _ in range(num)]
    return Counter(sample_rows(logits.expand(num, -1), requests))


def entropy(counts: Counter[int]) -> float:
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def test_temperature_scales_entropy() -> None:
    entropies = [entropy(draw(SamplingParams(temperature=t))) for t in (0.3, 1.0, 3.0)]
    assert entropies[0] < entropies[1] < entropies[2]


def test_distribution_matches_softmax_chi_square() -> None:
    num, temperature = 20000, 0.7
    counts = draw(SamplingParams(temperature=temperature), num=num)
    expected = torch.softmax(LOGITS / temperature, dim=-1) * num
    chi2 = sum((counts[i] - expected[i].item()) ** 2 / expected[i].item() for i in range(VOCAB))
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_top_k_support_size() -> None:
    assert set(draw(SamplingParams(top_k=3))) == {0, 1, 2}
    assert len(draw(SamplingParams(top_k=-1))) == VOCAB


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    assert set(draw(SamplingParams(top_p=0.7), logits=logits)) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.8), logits=logits)) == {0, 1, 2}
    assert set(draw(SamplingParams(top_p=0.4), logits=logits)) == {0}
    # top_k applies before top_p.
    assert set(draw(SamplingParams(top_p=0.95, top_k=2), logits=logits)) == {0, 1}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draw(SamplingParams(min_p=0.2), logits=logits)) == {0, 1, 2}


def test_greedy_equals_argmax_in_mixed_batch() -> None:
    logits = torch.randn(64, 100)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(64)]
    out = sample_rows(logits, [make_request(p) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in range(1, 64, 2)] == argmax[1::2]
    assert sample_rows(logits, [make_request(SamplingParams(temperature=0))] * 64) == argmax


def test_repetition_penalty_hf_style() -> None:
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Positive logits are divided, negative ones multiplied; prompt and output both count.
    assert sample_rows(torch.tensor([[2.0, 1.5, 0.0]]), [make_request(greedy, (0,))]) == [1]
    assert sample_rows(torch.tensor([[2.0, 1.5, 0.0]]), [make_request(greedy, (2,), (0,))]) == [1]
    assert sample_rows(torch.tensor([[-1.0, -1.5, -9.0]]), [make_request(greedy, (0,))]) == [1]
    flat = torch.zeros(VOCAB)
    counts = draw(SamplingParams(repetition_penalty=1.5), logits=flat + 3.0, prompt=(0,))
    assert counts[0] < min(counts[i] for i in range(1, VOCAB)) * 0.6


def test_frequency_and_presence_penalties_count_output_only() -> None:
    logits = torch.tensor([[1.0, 0.0, -5.0]])
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 0.5}):
        params = SamplingParams(temperature=0, **penalty)
        # In the prompt only: no effect.
        assert sample_rows(logits, [make_request(params, (0, 0, 0))]) == [0]
        assert sample_rows(logits, [make_request(params, (1,), (0, 0, 0))]) == [1]
    frequency = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert sample_rows(logits, [make_request(frequency, (1,), (0,))]) == [0]  # 1 - 0.5 > 0
    counts = draw(SamplingParams(frequency_penalty=1.0), logits=torch.zeros(VOCAB), output=(3,))
    assert counts[3] < min(counts[i] for i in range(VOCAB) if i != 3) * 0.6


def test_sparse_penalties_match_dense_reference() -> None:
    vocab = 30
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(presence_penalty=1.1, temperature=0),
    ]
    requests = [
        make_request(p, prompt=tuple(torch.randint(vocab, (9,)).tolist()), output=output)
        for p, output in zip(params, [(1, 1, 2), (3,), (4, 4, 4, 5), (), (6, 6)], strict=True)
    ]
    logits = torch.randn(len(requests), vocab)
    got = logits.clone()
    apply_logits_processing(got, SamplingMetadata.from_requests(requests, vocab, "cpu"))
    expected = logits.clone()
    for row, request in enumerate(requests):
        p, out = request.sampling_params, request.output_token_ids
        for token in set(request.prompt_token_ids) | set(out):
            value = expected[row, token]
            penalty = p.repetition_penalty
            expected[row, token] = value / penalty if value > 0 else value * penalty
        for token, count in Counter(out).items():
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    torch.testing.assert_close(got, expected)


def test_top_k_top_p_fast_path_matches_sorting_path() -> None:
    logits = torch.randn(16, 200) * 3
    top_k = torch.randint(1, 200, (16,))
    top_p = torch.rand(16, 1) * 0.9 + 0.1
    fast, general = logits.clone(), logits.clone()
    _apply_top_k_then_top_p(fast, top_k, int(top_k.max()), top_p)
    _apply_top_k_top_p(general, top_k, top_p)
    torch.testing.assert_close(fast, general)


def test_logit_bias_forces_and_forbids() -> None:
    assert set(draw(SamplingParams(logit_bias={"5": 100}), num=500)) == {5}
    counts = draw(SamplingParams(logit_bias={0: -100, 1: -100}), num=2000)
    assert 0 not in counts and 1 not in counts


def test_logit_bias_past_float32_is_clamped() -> None:
    """1e39 is an infinity in float32, which turns a sampled row's softmax into NaNs; it
    is clamped to 100 (vLLM's range), so it forces its token like any large bias."""
    params = SamplingParams(logit_bias={"5": 1e39, "7": -1e300, "8": 3})
    assert params.logit_bias == {5: 100.0, 7: -100.0, 8: 3.0}
    assert set(draw(SamplingParams(logit_bias={"5": 1e39}), num=500)) == {5}


def test_allowed_token_ids_restrict_support() -> None:
    assert set(draw(SamplingParams(allowed_token_ids=[3, 6]))) == {3, 6}


class FakeTokenizer:
    words = {"foo": [5], " foo": [6], "bar baz": [3, 4], " bar baz": [2, 4], "qux": [1]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.words.get(text, [0, 0, 0])


def test_bad_words_token_ids_follow_vllm_rule() -> None:
    params = SamplingParams(bad_words=["foo", "bar baz", "qux"])
    params.update_from_tokenizer(None, FakeTokenizer())
    # " qux" encodes to 3 tokens (not the length of "qux"), so only one variant.
    assert params.bad_words_token_ids == [[5], [6], [3, 4], [2, 4], [1]]


def test_bad_words_never_produced() -> None:
    params = SamplingParams(bad_words=["foo", "bar baz"])
    params.update_from_tokenizer(None, FakeTokenizer(), vocab_size=VOCAB)
    flat = torch.zeros(VOCAB)
    counts = draw(params, logits=flat, output=(3,))
    assert not {4, 5, 6} & set(counts)
    counts = draw(params, logits=flat, output=(1,))
    assert 4 in counts and not {5, 6} & set(counts)  # "4" alone is fine


def test_min_tokens_blocks_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[1])
    params.update_from_tokenizer(0)
    assert params.all_stop_token_ids == {0, 1}
    counts = draw(params, num=2000, output=(4, 4))
    assert 0 not in counts and 1 not in counts
    counts = draw(params, num=2000, output=(4, 4, 4))
    assert 0 in counts and 1 in counts
    # The request's own eos is banned too, even before update_from_tokenizer.
    counts = draw(SamplingParams(min_tokens=2), num=2000, eos=0)
    assert 0 not in counts


@pytest.mark.parametrize("seeded", [{}, {"top_k": 10, "top_p": 0.9, "temperature": 0.5}])
def test_seeded_row_ignores_batch_composition_and_order(seeded: dict) -> None:
    def run(layout: str, steps: int = 12) -> list[int]:
        requests = {
            "s": make_request(SamplingParams(seed=42, **seeded), request_id="s"),
            "t": make_request(SamplingParams(seed=7, top_k=5), request_id="t"),
            "u": make_request(SamplingParams(), request_id="u"),
        }
        requests["g"] = make_request(SamplingParams(temperature=0), request_id="g")
        batch = [requests[name] for name in layout]
        tokens = []
        for _ in range(steps):
            logits = torch.randn(len(batch), 50)
            logits[layout.index("s")] = torch.linspace(-1, 1, 50)
            out = sample_rows(logits, batch)
            tokens.append(out[layout.index("s")])
        return tokens

    reference = run("s")
    assert len(set(reference)) > 1
    for layout in ("us", "sug", "gtus", "tsg"):
        assert run(layout) == reference


def test_unseeded_requests_differ_across_calls() -> None:
    request = make_request(SamplingParams())
    logits = torch.zeros(64, 100)
    assert sample_rows(logits, [request] * 64) != sample_rows(logits, [request] * 64)


def test_logprobs_are_raw_with_ranks_and_topk() -> None:
    logits = torch.randn(3, 20)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.3, top_k=4),
        SamplingParams(),
        SamplingParams(logprobs=-1, temperature=0),
    ]
    requests = [make_request(p, prompt=(1, 2), output=(3,)) for p in params]
    metadata = SamplingMetadata.from_requests(requests, 20, "cpu")
    out = Sampler()(logits.clone(), metadata)
    raw = torch.log_softmax(logits, dim=-1)
    lists = out.logprobs
    assert lists is not None
    for row, token in enumerate(out.sampled_token_ids):
        assert lists.token_ids[row] == token
        assert lists.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lists.ranks[row] == int((raw[row] >= raw[row, token]).sum())
    assert lists.topk_token_ids[0] == raw[0].topk(3).indices.tolist()
    assert lists.topk_logprobs[0] == pytest.approx(raw[0].topk(3).values.tolist())
    assert lists.topk_token_ids[1] == []
    assert len(lists.topk_token_ids[2]) == 20
    assert lists.ranks[2] == 1


def test_no_logprobs_when_none_asked() -> None:
    request = make_request(SamplingParams())
    metadata = SamplingMetadata.from_requests([request], VOCAB, "cpu")
    assert Sampler()(LOGITS.unsqueeze(0).clone(), metadata).logprobs is None


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, 30)
    next_ids = torch.tensor([3, 0, 29, 7, 7])
    lists = compute_prompt_logprobs(logits, next_ids, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert lists.token_ids == next_ids.tolist()
    assert lists.logprobs == pytest.approx(raw[torch.arange(5), next_ids].tolist(), abs=1e-6)
    assert lists.ranks == [int((raw[i] >= raw[i, t]).sum()) for i, t in enumerate(next_ids)]
    assert lists.topk_token_ids == raw.topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, next_ids, 0).topk_token_ids == [[]] * 5
    rows = list(lists)
    assert len(rows) == 5 and rows[2].sampled_token_id == 29
    assert (
        rows[2].sampled_rank == lists.ranks[2] and rows[2].top_token_ids == lists.topk_token_ids[2]
    )


# SamplingParams


def test_params_normalisation() -> None:
    params = SamplingParams(stop="x", top_k=-1, logit_bias={"3": 1}, seed=-1)
    assert params.stop == ["x"] and params.stop_token_ids == [] and params.top_k == 0
    assert params.logit_bias == {3: 1.0} and params.seed is None
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert params.sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.3)
    assert greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3


def test_params_clone_and_stop_ids() -> None:
    params = SamplingParams(stop=["a"], stop_token_ids=[4], ignore_eos=True)
    params.update_from_tokenizer([2, 3])
    assert params.all_stop_token_ids == {4}
    clone = params.clone()
    clone.stop.append("b")
    assert params.stop == ["a"] and clone.all_stop_token_ids == {4}
    other = SamplingParams(stop_token_ids=[4])
    other.update_from_tokenizer(2)
    assert other.all_stop_token_ids == {2, 4}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n must"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"n": 1, "best_of": 2, "output_kind": RequestOutputKind.DELTA}, "best_of"),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy"),
        ({"best_of": 2, "temperature": 0}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -5}, "prompt_logprobs"),
        ({"stop": ["a", ""]}, "stop"),
        ({"seed": 2**63}, "seed"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"stop": "x", "detokenize": False}, "detokenize"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_params_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_accept_edges() -> None:
    SamplingParams(logprobs=-1, prompt_logprobs=0, max_tokens=None, top_k=0, min_p=1.0)
    SamplingParams(n=2, best_of=3, seed=-(2**63))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"allowed_token_ids": [1, 99]}, "allowed_token_ids"),
        ({"logit_bias": {99: 1.0}}, "logit_bias"),
        ({"bad_words": ["x"]}, "bad_words"),
    ],
)
def test_update_from_tokenizer_checks_vocab(kwargs: dict, field: str) -> None:
    class BigIds:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [500]

    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).update_from_tokenizer(0, BigIds(), vocab_size=10)
    with pytest.raises(ValueError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(0)
