"""Speculative decoding (``--speculative-config``): cheap proposals of the next few tokens,
verified by the target model in one step, kept so that the output is distributed exactly
as without speculation.

A request in its decode phase gets up to ``num_speculative_tokens`` draft tokens from the
proposer (``ngram``: prompt lookup, the tokens that followed the latest earlier
occurrence of the request's last n-gram; or a draft model's greedy continuation). The
scheduler schedules the last sampled token and the drafts together; the runner takes the
target's distribution at each of those positions and keeps the drafts one by one by
rejection sampling. The drafts are proposals ``q`` that put all their mass on one token
(deterministic proposers), so draft ``d`` is kept with probability ``p(d)`` (always when
greedy and ``d`` is the argmax); at the first rejection the token is drawn from ``p``
without ``d`` (renormalized: ``max(0, p - q)``), and when every draft is kept a bonus
token is drawn from the last position. Greedy outputs are therefore identical to no
speculation, and sampled ones have the target distribution.

Drafts go only to requests whose sampling the runner can verify per position without
sequence state: no repetition/frequency/presence penalties, bad words, guided decoding,
logprobs, or pending ``min_tokens``; the others decode one token a step as usual. Nor do
sequences too long for the draft: as vLLM's, a request is speculated only while its
length (prompt and generated tokens) plus ``num_speculative_tokens`` stays under
``max_model_len`` (given, or the draft model's context where it is shorter than the
target's).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.configs.runtime import SpeculativeConfig
from pagedllm.core.errors import ConfigError


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier occurrence of the sequence's
    last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, wanted: list[tuple[Any, int, list[int]]]) -> list[list[int]]:
        """Drafts for each ``(request, room, block ids)``."""
        return [self.lookup(request.all_token_ids, room) for request, room, _ in wanted]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens = torch.tensor(token_ids)
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            windows = tokens[: length - 1].unfold(0, n, 1)  # starts 0 .. length - 1 - n
            hits = (windows == suffix).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []


def speculation_limit(
    config: SpeculativeConfig, target_len: int, draft_len: int | None = None
) -> SpeculativeConfig:
    """``config`` with the length that stops speculation settled, as vLLM's: the given
    ``max_model_len`` (at most the target's and the draft model's context ``draft_len``),
    else the draft's context where it is shorter than the target's."""
    limit = config.max_model_len
    for length, whose in ((target_len, "the target's"), (draft_len, "the draft model's")):
        if limit is not None and length is not None and limit > length:
            raise ConfigError(
                f"--speculative-config: max_model_len {limit} is larger than {whose} "
                f"context ({length} tokens)"
            )
    if limit is None and draft_len is not None and draft_len < target_len:
        limit = draft_len
    return config.replace(max_model_len=limit)


def make_proposer(config: SpeculativeConfig | None) -> Any:
    """The proposer for ``config`` (None without speculative decoding). A draft model's
    proposer is given its model by the engine (:class:`DraftModelProposer`)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    return None  # (the engine passes the draft model's proposer to the scheduler)


def can_speculate(request: Any) -> bool:
    """Whether the runner can verify drafts for ``request`` position by position."""
    params = request.sampling_params
    return (
        request.samples_tokens
        and "guided" not in request.features
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.bad_words_token_ids
        and request.num_output_tokens >= params.min_tokens
        and params.n == 1
    )


def accept_drafts(
    probs: torch.Tensor | None,
    greedy_tokens: torch.Tensor | None,
    drafts: list[int],
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a verification step appends: the kept drafts, then one more (a
    correction at the first rejection, or a bonus). ``probs`` ``[k + 1, vocab]`` is the
    target's sampling distribution at each position (None for a greedy request, whose
    ``greedy_tokens`` ``[k + 1]`` are the argmaxes)."""
    if probs is None:
        assert greedy_tokens is not None
        best = greedy_tokens.tolist()
        kept = []
        for i, draft in enumerate(drafts):
            if best[i] != draft:
                return [*kept, best[i]]
            kept.append(draft)
        return [*kept, best[len(drafts)]]
    kept = []
    for i, draft in enumerate(drafts):
        row = probs[i]
        u = torch.rand((), generator=generator, device=row.device)
        if u < row[draft]:
            kept.append(draft)
            continue
        residual = row.clone()
        residual[draft] = 0.0
        if residual.sum() <= 0:  # (p was all on the draft: it cannot be rejected)
            kept.append(draft)
            continue
        token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return [*kept, int(token)]
    bonus = torch.multinomial(probs[len(drafts)], 1, generator=generator)
    return [*kept, int(bonus)]


class DraftModelProposer:
    """A smaller model sharing the target's vocabulary proposes its greedy continuation.

    Its KV cache has the target cache's block layout (the same block ids, its own
    tensors), so a request's draft KV lives in the blocks the scheduler gave the request.
    For each request it remembers how many tokens have their draft KV written; a
    proposal first catches up on the tokens since (the prompt, the tokens kept last step)
    in one step, then feeds its own drafts back one at a time. Drafts the target rejected
    are recomputed later (only tokens the target kept count as written)."""

    def __init__(
        self,
        model: Any,
        kv_spec: Any,
        num_blocks: int,
        block_size: int,
        backend: Any,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.kv_caches = kv_spec.allocate(num_blocks, block_size, device)
        # request id -> (its preemption count, tokens whose draft KV is written)
        self._written: dict[str, tuple[int, int]] = {}

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Any, int, list[int]]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        inputs: list[list[int]] = []
        starts: list[int] = []
        for request, _, _ in wanted:
            preemptions, written = self._written.get(request.request_id, (-1, 0))
            if preemptions != request.num_preemptions:
                written = 0  # (its blocks were freed: the draft KV is gone)
            written = min(written, request.num_computed_tokens)
            inputs.append(request.all_token_ids[written:])
            starts.append(written)
        active = list(range(len(wanted)))
        while active:
            token_ids: list[int] = []
            positions: list[int] = []
            query_lens: list[int] = []
            context_lens: list[int] = []
            tables: list[list[int]] = []
            for i in active:
                token_ids.extend(inputs[i])
                positions.extend(range(starts[i], starts[i] + len(inputs[i])))
                query_lens.append(len(inputs[i]))
                context_lens.append(starts[i] + len(inputs[i]))
                tables.append(wanted[i][2])
            metadata = self.backend.build_metadata(
                query_lens, context_lens, tables, self.block_size, self.kv_caches, self.device
            )
            hidden = self.model(
                torch.tensor(token_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                metadata,
            )
            last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last])[:, : self.vocab_size]
            proposed = logits.argmax(dim=-1).tolist()
            still = []
            for i, token in zip(active, proposed, strict=True):
                drafts[i].append(token)
                starts[i] += len(inputs[i])
                inputs[i] = [token]
                if len(drafts[i]) < wanted[i][1]:
                    still.append(i)
            active = still
        # Tokens with draft KV now: everything fed, the last draft excepted; only those
        # the target keeps stay valid (clamped to its computed tokens next time).
        self._written = {
            request.request_id: (request.num_preemptions, starts[i])
            for i, (request, _, _) in enumerate(wanted)
        }
        return drafts


def verify_drafts(request: Any, logits: torch.Tensor, drafts: list[int], device: Any) -> list[int]:
    """The tokens kept of a request's ``drafts``, from the target's logits at its last
    known token and at each draft (processed as the sampler processes them), by the
    rejection sampler (:func:`accept_drafts`)."""
    from pagedllm.core.sampling import SamplingMetadata
    from pagedllm.core.sampling.sampler import apply_logits_processing, warp

    logits = logits.float().contiguous()
    md = SamplingMetadata.from_requests([request] * len(logits), logits.shape[-1], device)
    apply_logits_processing(logits, md)
    if md.all_greedy:
        return accept_drafts(None, logits.argmax(dim=-1), drafts, None)
    warp(logits, md)
    return accept_drafts(logits.softmax(dim=-1), None, drafts, md.generators.get(0))
