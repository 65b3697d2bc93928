"""The sampler: logits of one step -> one token per request, plus the logprobs asked for.

Processing order (vLLM V1's): allowed_token_ids (and the caller's ``token_mask``), bad
words and min_tokens bans, logit_bias, repetition penalty, frequency and presence
penalties; then greedy rows take the argmax, and random rows go through temperature,
min_p, top_k, top_p and an exponential race. Logprobs are "raw": the log-softmax of the
model's logits before any of this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from pagedllm.core.sampling.metadata import SamplingMetadata
from pagedllm.kernels.cpu_ops import cpu_ops

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


@dataclasses.dataclass(slots=True)
class LogprobsLists:
    """Per row: a chosen token (the sampled one, or the actual next prompt token), its
    logprob and 1-based rank in the vocabulary (vLLM's rank: the number of tokens whose
    logprob is >= its own), and the row's top-k ids and logprobs, best first.

    Rows that asked for no logprobs (``logprobs=None``) have empty top-k lists; their
    token logprob and rank are filled anyway and may be ignored.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    topk_token_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.token_ids)

    def row(self, index: int) -> LogprobsRow:
        return LogprobsRow(
            sampled_token_id=self.token_ids[index],
            sampled_logprob=self.logprobs[index],
            sampled_rank=self.ranks[index],
            top_token_ids=self.topk_token_ids[index],
            top_logprobs=self.topk_logprobs[index],
        )

    def __iter__(self) -> Iterator[LogprobsRow]:
        return (self.row(i) for i in range(len(self)))


@dataclasses.dataclass(frozen=True, slots=True)
class LogprobsRow:
    """One row of :class:`LogprobsLists`; for prompt logprobs, the "sampled" token is the
    actual next prompt token."""

    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None  # None when no row of the batch asked for logprobs


class Sampler:
    """Stateless; the per-request state (seeded generators) lives in the metadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[num_reqs, vocab_size]``.

        ``logits`` is modified in place when it is contiguous float32 (the runner does not
        reuse it); other dtypes are converted first.
        """
        assert logits.shape == (metadata.num_reqs, metadata.vocab_size), logits.shape
        logits = logits.float().contiguous()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        apply_logits_processing(logits, metadata)
        sampled = sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(
                raw_logprobs, sampled, metadata.max_num_logprobs, metadata.num_logprobs
            )
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)


def apply_logits_processing(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Masks, bans, bias and penalties, in place; each step is skipped when unused."""
    if md.allowed_rows is not None:
        assert md.allowed_mask is not None
        rows = logits[md.allowed_rows]
        logits[md.allowed_rows] = rows.masked_fill_(~md.allowed_mask, _NEG_INF)
    if md.token_mask is not None:
        logits.masked_fill_(~md.token_mask, _NEG_INF)
    if md.banned_rows is not None:
        assert md.banned_token_ids is not None
        logits[md.banned_rows, md.banned_token_ids] = _NEG_INF
    if md.bias_rows is not None:
        assert md.bias_token_ids is not None and md.bias_values is not None
        logits.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.output_index is not None:
        _apply_penalties(logits.view(-1), md)


def _apply_penalties(flat_logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition (HF): the logit of a token seen in the prompt or the output is divided by
    the penalty when positive, multiplied when negative. Frequency and presence (OpenAI),
    on output tokens only: ``count * frequency + (count > 0) * presence`` is subtracted.

    Repeated indexes are harmless: each write of a repeated index stores the same value.
    """
    output_index = md.output_index
    assert output_index is not None
    if md.repetition_output is not None:
        assert md.prompt_index is not None and md.repetition_prompt is not None
        index = torch.cat([output_index, md.prompt_index])
        penalty = torch.cat([md.repetition_output, md.repetition_prompt])
        values = flat_logits[index]
        flat_logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if md.frequency_output is not None:
        flat_logits.index_add_(0, output_index, md.frequency_output, alpha=-1)
    if md.presence_output is not None:
        flat_logits[output_index] = flat_logits[output_index] - md.presence_output


def warp(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Temperature, min-p, top-k and top-p, in place: the logits whose softmax is the
    distribution a random row draws from."""
    if md.temperature is not None:
        logits.div_(md.temperature)
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * md.min_p
        logits.masked_fill_(probs < threshold, _NEG_INF)
    if md.top_k is not None and md.all_top_k:
        _apply_top_k_then_top_p(logits, md.top_k, md.max_top_k, md.top_p)
    elif md.top_p is not None:
        _apply_top_k_top_p(logits, md.top_k, md.top_p)
    elif md.top_k is not None:
        _apply_top_k(logits, md.top_k, md.max_top_k)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One token id per row (long ``[num_reqs]``); random rows modify ``logits``."""
    if md.all_greedy:
        return logits.argmax(dim=-1)
    greedy = logits.argmax(dim=-1) if md.greedy_mask is not None else None
    warp(logits, md)
    # Inverse CDF: one uniform per row, found in the row's cumulative distribution. A
    # seeded row draws its uniform from its own generator, so it ignores the rest of the
    # batch. U is scaled by the row's total (cumsum rounding) and kept > 0, so a token of
    # probability 0 (a flat step of the CDF) is never the first index reaching U.
    uniform = torch.empty((md.num_reqs, 1), dtype=torch.float32, device=logits.device)
    if len(md.generators) < md.num_reqs:
        uniform.uniform_(_TINY, 1.0)
    for row, generator in md.generators.items():
        uniform[row].uniform_(_TINY, 1.0, generator=generator)
    ops = cpu_ops() if logits.device.type == "cpu" else None
    if ops is not None:  # the same search, fused (csrc/cpu_ops.c)
        sampled = ops.sample_inverse_cdf(logits, uniform)
    else:
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        uniform.mul_(cdf[:, -1:])
        sampled = torch.searchsorted(cdf, uniform).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    if greedy is not None:
        sampled = torch.where(md.greedy_mask, greedy, sampled)
    return sampled


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep each row's ``top_k`` largest logits (ties at the k-th kept); 0 keeps all."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    kth.masked_fill_((top_k == 0).unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < kth, _NEG_INF)


def _apply_top_k_then_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int, top_p: torch.Tensor | None
) -> None:
    """Top-k (exactly k, ties broken by ``topk``) and then top-p within the k survivors:
    the fast path when every random row has a top_k, sorting ``max_top_k`` values only."""
    values, indices = logits.topk(max_top_k, dim=-1)  # descending
    positions = torch.arange(max_top_k, device=logits.device)
    values.masked_fill_(positions >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = values.softmax(dim=-1)
        # A token goes when the more likely tokens already reach top_p.
        values.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p, _NEG_INF)
    logits.fill_(_NEG_INF).scatter_(1, indices, values)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> None:
    """Top-k, then keep the smallest set of most likely tokens whose mass reaches top_p."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k == 0, vocab_size, top_k).clamp(max=vocab_size)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token goes when the tokens below it (itself included) hold at most 1 - top_p,
    # i.e. when the tokens above it already reach top_p. The best token always stays.
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    logits.scatter_(1, order, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    max_num_logprobs: int,
    num_logprobs: list[int | None],
) -> LogprobsLists:
    """The logprob and rank of ``token_ids[i]`` in row i, and row i's top
    ``num_logprobs[i]`` (``None`` = 0), computing one top-``max_num_logprobs`` for all."""
    token_ids = token_ids.long()
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    topk_ids: list[list[int]] = [[] for _ in num_logprobs]
    topk_logprobs: list[list[float]] = [[] for _ in num_logprobs]
    if max_num_logprobs > 0:
        values, indices = logprobs.topk(max_num_logprobs, dim=-1)
        all_values, all_indices = values.tolist(), indices.tolist()
        for row, k in enumerate(num_logprobs):
            if k:
                topk_ids[row] = all_indices[row][:k]
                topk_logprobs[row] = all_values[row][:k]
    return LogprobsLists(
        token_ids=token_ids.tolist(),
        logprobs=token_logprobs.squeeze(1).tolist(),
        ranks=ranks.tolist(),
        topk_token_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsLists:
    """Prompt logprobs: for each position (row of ``logits``), the logprob and rank of the
    actual next prompt token ``next_token_ids[i]`` and the top ``num_logprobs`` (-1 = the
    whole vocabulary), all from the raw logits."""
    vocab_size = logits.shape[-1]
    k = vocab_size if num_logprobs == -1 else min(num_logprobs, vocab_size)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, next_token_ids.to(logits.device), k, [k] * len(logits))
