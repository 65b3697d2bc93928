"""``SamplingMetadata``: one step's sampling inputs, batched into tensors.

Every optional part is ``None`` when no row of the batch needs it, so that the common
batch (no penalties, no bans, no logprobs) costs a few small tensors and an argmax.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from pagedllm.core.sampling.params import SAMPLING_EPS
from pagedllm.core.transfer import host_tensor

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pagedllm.core.request import Request

# Keys this module keeps in Request.sampler_state.
GENERATOR_KEY = "generator"
_PROMPT_IDS_KEY = "sampling.prompt_ids"
_ALLOWED_IDS_KEY = "sampling.allowed_ids"


@dataclasses.dataclass(slots=True)
class SamplingMetadata:
    """Row ``i`` of every ``[num_reqs, ...]`` tensor is ``requests[i]``.

    Sparse parts address the logits by (row, token) pairs, or by flat indexes
    ``row * vocab_size + token`` into ``logits.view(-1)``, so that their cost grows with the
    number of tokens involved, not with ``num_reqs * vocab_size``. ``token_mask`` is for
    the caller (e.g. a guided-decoding bitmask as bool, ``True`` = allowed).
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    greedy_mask: torch.Tensor | None  # bool [R]; only when greedy and random rows mix
    temperature: torch.Tensor | None  # float [R, 1]; greedy rows hold 1.0
    min_p: torch.Tensor | None  # float [R, 1]
    top_k: torch.Tensor | None  # long [R]; 0 = disabled
    max_top_k: int
    all_top_k: bool  # every random row has a top_k
    top_p: torch.Tensor | None  # float [R, 1]
    generators: dict[int, torch.Generator]  # row -> generator of a seeded random row
    allowed_rows: torch.Tensor | None
    allowed_mask: torch.Tensor | None  # bool [len(allowed_rows), V]; True = allowed
    banned_rows: torch.Tensor | None  # with banned_token_ids: (row, token) pairs -> -inf
    banned_token_ids: torch.Tensor | None
    bias_rows: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    # Flat index of every output token of the penalised rows (repeats included), with
    # each entry's penalties; None where no row uses that penalty.
    output_index: torch.Tensor | None = None
    repetition_output: torch.Tensor | None = None
    frequency_output: torch.Tensor | None = None
    presence_output: torch.Tensor | None = None
    # Flat index of the distinct prompt tokens of the rows with a repetition penalty.
    prompt_index: torch.Tensor | None = None
    repetition_prompt: torch.Tensor | None = None
    num_logprobs: list[int | None] = dataclasses.field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row wants logprobs
    token_mask: torch.Tensor | None = None

    @classmethod
    def from_requests(
        cls, requests: list[Request], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        """Batch the requests that sample a token this step, in row order.

        Contract: ``requests`` holds exactly the requests whose sampled token will be kept
        (not those in the middle of a chunked prefill), and each one's
        ``output_token_ids`` holds every token sampled before this step. A seeded request's
        generator lives in ``sampler_state["generator"]`` and advances once per sampled
        token, so its tokens depend neither on the rest of the batch nor on preemption.
        Raises ``ValueError`` for an out-of-vocabulary id in ``allowed_token_ids`` or
        ``logit_bias``.
        """
        greedy: list[bool] = []
        temperature: list[float] = []
        min_p: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        generators: dict[int, torch.Generator] = {}
        num_logprobs: list[int | None] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        penalty_rows: list[int] = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            is_greedy = params.temperature < SAMPLING_EPS
            greedy.append(is_greedy)
            temperature.append(1.0 if is_greedy else params.temperature)
            min_p.append(params.min_p)
            # A greedy row's top_k is a placeholder: its token is the argmax anyway.
            top_k.append(1 if is_greedy else min(params.top_k, vocab_size))
            top_p.append(params.top_p)
            if params.seed is not None and not is_greedy:
                generators[row] = _generator(request, device)
            k = params.logprobs
            if k is not None:
                k = vocab_size if k == -1 else min(k, vocab_size)
            num_logprobs.append(k)
            outputs = request.output_token_ids
            for ids in params.bad_words_token_ids:
                prefix_len = len(ids) - 1
                if ids[-1] < vocab_size and (prefix_len == 0 or outputs[-prefix_len:] == ids[:-1]):
                    banned_rows.append(row)
                    banned_ids.append(ids[-1])
            if len(outputs) < params.min_tokens:
                stop_ids = set(params.all_stop_token_ids)
                if request.eos_token_id is not None and not params.ignore_eos:
                    stop_ids.add(request.eos_token_id)
                stop_ids = {t for t in stop_ids if t < vocab_size}
                banned_rows.extend([row] * len(stop_ids))
                banned_ids.extend(stop_ids)
            if params.logit_bias:
                _check_vocab("logit_bias", params.logit_bias, vocab_size)
                bias_rows.extend([row] * len(params.logit_bias))
                bias_ids.extend(params.logit_bias)
                bias_values.extend(params.logit_bias.values())
            if params.allowed_token_ids is not None:
                allowed_rows.append(row)
            if (
                params.repetition_penalty != 1.0
                or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0
            ):
                penalty_rows.append(row)

        def floats(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return host_tensor(values, torch.float32, device).unsqueeze(1)

        def longs(values: list[int]) -> torch.Tensor | None:
            return host_tensor(values, torch.long, device) if values else None

        all_greedy = all(greedy)
        random_top_k = [k for k, g in zip(top_k, greedy, strict=True) if not g]
        wanted = [k for k in num_logprobs if k is not None]
        metadata = cls(
            num_reqs=len(requests),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_mask=(
                host_tensor(greedy, torch.bool, device) if any(greedy) and not all_greedy else None
            ),
            temperature=None if all_greedy else floats(temperature, 1.0),
            min_p=None if all_greedy else floats(min_p, 0.0),
            top_k=None if all(k == 0 for k in random_top_k) else longs(top_k),
            max_top_k=max(top_k, default=0),
            all_top_k=all(k > 0 for k in random_top_k),
            top_p=None if all_greedy else floats(top_p, 1.0),
            generators=generators,
            allowed_rows=longs(allowed_rows),
            allowed_mask=_allowed_mask(requests, allowed_rows, vocab_size, device),
            banned_rows=longs(banned_rows),
            banned_token_ids=longs(banned_ids),
            bias_rows=longs(bias_rows),
            bias_token_ids=longs(bias_ids),
            bias_values=(host_tensor(bias_values, torch.float32, device) if bias_values else None),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
        )
        if penalty_rows:
            _add_penalties(metadata, requests, penalty_rows, device)
        return metadata


def _add_penalties(
    metadata: SamplingMetadata,
    requests: list[Request],
    rows: list[int],
    device: torch.device | str,
) -> None:
    vocab_size = metadata.vocab_size
    flat: list[int] = []
    lengths: list[int] = []
    for row in rows:
        outputs = requests[row].output_token_ids
        flat.extend(outputs)
        lengths.append(len(outputs))
    offsets = torch.tensor(rows, dtype=torch.long, device=device) * vocab_size
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    index = torch.tensor(flat, dtype=torch.long, device=device)
    metadata.output_index = index + torch.repeat_interleave(offsets, counts)

    def per_entry(name: str, neutral: float) -> torch.Tensor | None:
        values = [getattr(requests[row].sampling_params, name) for row in rows]
        if all(v == neutral for v in values):
            return None
        per_row = torch.tensor(values, dtype=torch.float32, device=device)
        return torch.repeat_interleave(per_row, counts)

    metadata.repetition_output = per_entry("repetition_penalty", 1.0)
    metadata.frequency_output = per_entry("frequency_penalty", 0.0)
    metadata.presence_output = per_entry("presence_penalty", 0.0)
    if metadata.repetition_output is None:
        return
    prompt_rows = [row for row in rows if requests[row].sampling_params.repetition_penalty != 1]
    prompt_ids = []
    for row in prompt_rows:
        request = requests[row]
        if _PROMPT_IDS_KEY not in request.sampler_state:
            # Ids past the logits' width cannot be sampled, so they need no penalty.
            prompt = [t for t in request.prompt_token_ids if t < vocab_size]
            _cached_ids(request, _PROMPT_IDS_KEY, prompt, device)
        prompt_ids.append(request.sampler_state[_PROMPT_IDS_KEY])
    metadata.prompt_index, prompt_counts = _flat_index(prompt_ids, prompt_rows, vocab_size, device)
    penalties = [requests[row].sampling_params.repetition_penalty for row in prompt_rows]
    metadata.repetition_prompt = torch.repeat_interleave(
        torch.tensor(penalties, dtype=torch.float32, device=device), prompt_counts
    )


def _generator(request: Request, device: torch.device | str) -> torch.Generator:
    generator = request.sampler_state.get(GENERATOR_KEY)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(request.sampling_params.seed)
        request.sampler_state[GENERATOR_KEY] = generator
    return generator


def _check_vocab(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = sorted(t for t in token_ids if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(
            f"{name} contains out-of-vocabulary token id(s) {bad[:10]}; "
            f"token ids must be in [0, {vocab_size})."
        )


def _cached_ids(
    request: Request, key: str, ids: list[int], device: torch.device | str
) -> torch.Tensor:
    """The distinct ``ids`` as a device tensor, made once per request."""
    cached = request.sampler_state.get(key)
    if cached is None:
        cached = torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
        request.sampler_state[key] = cached
    return cached


def _flat_index(
    ids: list[torch.Tensor], rows: list[int], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indexes ``rows[j] * vocab_size + ids[j]`` (concatenated), and ``len(ids[j])``."""
    lengths = torch.tensor([len(t) for t in ids], dtype=torch.long, device=device)
    offsets = torch.tensor(rows, dtype=torch.long, device=device) * vocab_size
    return torch.cat(ids) + torch.repeat_interleave(offsets, lengths), lengths


def _allowed_mask(
    requests: list[Request], rows: list[int], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    if not rows:
        return None
    ids = []
    for row in rows:
        allowed = requests[row].sampling_params.allowed_token_ids
        assert allowed is not None
        if _ALLOWED_IDS_KEY not in requests[row].sampler_state:
            _check_vocab("allowed_token_ids", allowed, vocab_size)
        ids.append(_cached_ids(requests[row], _ALLOWED_IDS_KEY, allowed, device))
    mask = torch.zeros(len(rows) * vocab_size, dtype=torch.bool, device=device)
    mask[_flat_index(ids, list(range(len(rows))), vocab_size, device)[0]] = True
    return mask.view(len(rows), vocab_size)
