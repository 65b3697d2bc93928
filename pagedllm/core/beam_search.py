"""Beam search (``LLM.beam_search``, the completions API's ``use_beam_search``), as vLLM
runs it: each step extends every live beam by one token with an ordinary request
(``max_tokens=1`` and the top ``2 * beam_width`` logprobs); the ``beam_width`` best
extensions of each prompt live on, those ending in EOS are set aside as finished. The
beams' common prefix is computed once: every step's requests find the prompt (and the
beam's earlier tokens) in the prefix cache, full blocks shared, and the partial last block
of their parent beam copied on write (its KV is kept after the parent's step:
``SamplingParams.keep_kv_tail``), so a step costs a beam its one new token.

Scores are vLLM's: a beam's cumulative logprob divided by its length (prompt included,
EOS excluded) to the power ``length_penalty``; running beams of one prompt share their
length, so they compete by cumulative logprob alone, as transformers' beams do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.core.outputs import PositionLogprobs
from pagedllm.core.sampling import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` is the prompt followed by the beam's output."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclasses.dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, penalty: float
) -> float:
    """vLLM's beam score: ``cum_logprob / length ** length_penalty`` (length without a
    final EOS)."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**penalty)


class BeamSearch:
    """The state of a beam search over several prompts: :meth:`pending` gives the beams
    to extend, :meth:`advance` takes one finished one-token output per pending beam (in
    that order), :meth:`results` the best beams once :attr:`done`."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.steps = 0
        self.live = [
            [BeamSearchSequence(list(p), [], 0.0, num_prompt_tokens=len(p))] for p in prompts
        ]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    @property
    def step_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=1,
            logprobs=2 * self.params.beam_width,
            temperature=self.params.temperature,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            keep_kv_tail=True,
        )

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def pending(self) -> list[BeamSearchSequence]:
        return [beam for beams in self.live for beam in beams]

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(
            beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty
        )

    def advance(self, outputs: list[Any]) -> None:
        """Extend each pending beam by the candidates of its output's logprobs."""
        position = 0
        for index, beams in enumerate(self.live):
            candidates = []
            for beam in beams:
                output = outputs[position]
                position += 1
                top = output.outputs[0].logprobs[0]
                for token, logprob in top.items():
                    extended = BeamSearchSequence(
                        tokens=[*beam.tokens, token],
                        logprobs=[*beam.logprobs, top],
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                        num_prompt_tokens=beam.num_prompt_tokens,
                    )
                    if token == self.eos_token_id and not self.params.ignore_eos:
                        extended.finish_reason = "stop"
                        self.finished[index].append(extended)
                    else:
                        candidates.append(extended)
            candidates.sort(key=self._key, reverse=True)
            self.live[index] = candidates[: self.params.beam_width]
        self.steps += 1

    def results(self, tokenizer: Any) -> list[BeamSearchOutput]:
        outputs = []
        for finished, live in zip(self.finished, self.live, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            best = sorted([*finished, *live], key=self._key, reverse=True)[: self.params.beam_width]
            for beam in best:
                if tokenizer is not None:  # (as vLLM: the prompt's text and the beam's)
                    beam.text = tokenizer.decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs
