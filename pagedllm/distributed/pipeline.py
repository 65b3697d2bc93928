"""Pipeline parallelism (``-pp N``): the model's layers split over N processes (stages),
a step's requests split into micro-batches that are in flight on several stages at once.

Stage 0 is the engine's process: it schedules, embeds the tokens, runs its layers and,
at the end of the pipeline, computes the logits and samples. Stages 1 to N - 1 are the
worker processes of :mod:`pagedllm.distributed.executor`. Each step:

1. stage 0 splits the step's requests into micro-batches (contiguous runs of requests
   with about as many tokens each) and sends the workers the list, once, through their
   pipes (:class:`PipelineStep`);
2. it computes each micro-batch's first layers and sends the hidden states to stage 1
   (``isend``: it goes on with the next micro-batch while stage 1 computes this one);
3. stage ``s`` receives each micro-batch's hidden states from stage ``s - 1``, runs its
   layers and sends them on; the last stage (which holds the final norm) sends them back
   to stage 0;
4. stage 0 gathers the micro-batches' final hidden states in step order and computes the
   logits, samples, and so on, as without stages.

The stages overlap within a step: while stage 1 runs micro-batch ``i``, stage 0 runs
micro-batch ``i + 1``. Each stage's KV cache holds its own layers only.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.core.runner import StepInput


@dataclasses.dataclass(slots=True)
class PipelineStep:
    """What the stages past 0 take for a step: its micro-batches, in order."""

    micro_batches: list[StepInput]


def split_micro_batches(step: StepInput, count: int) -> list[StepInput]:
    """``step``'s requests in at most ``count`` contiguous runs of about equal tokens,
    each a :class:`StepInput` of its own (no logits rows: stage 0 computes those on the
    gathered hidden states). The KV blocks to copy go with the first."""
    lens = step.query_lens
    count = max(1, min(count, len(lens)))
    # tokens[j]: the tokens of the first j requests.
    tokens = list(itertools.accumulate(lens, initial=0))
    cuts = [0]
    for k in range(1, count):
        goal = tokens[-1] * k / count
        j = cuts[-1] + 1  # (at least one request per run, and one left for each after)
        while j < len(lens) - (count - k) and abs(tokens[j + 1] - goal) <= abs(tokens[j] - goal):
            j += 1
        cuts.append(j)
    cuts.append(len(lens))
    return [
        StepInput(
            token_ids=step.token_ids[tokens[a] : tokens[b]],
            positions=step.positions[tokens[a] : tokens[b]],
            query_lens=lens[a:b],
            context_lens=step.context_lens[a:b],
            block_tables=step.block_tables[a:b],
            blocks_to_copy=step.blocks_to_copy if a == 0 else [],
        )
        for a, b in itertools.pairwise(cuts)
    ]


class PipelineStages:
    """Stage 0's side of the pipeline: :meth:`hidden` runs a step through every stage.
    ``group``: the workers (stages 1..N-1), whose ``step`` sends them a message."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        # Micro-batches per step: one per stage keeps every stage busy once the pipeline
        # has filled, without cutting the batch into more small pieces than that.
        self.micro_batches = size
        # Steps and micro-batches sent through the stages (the tests read them).
        self.num_steps = 0
        self.num_micro_batches = 0

    def hidden(self, runner: Any, step: StepInput) -> torch.Tensor:
        """The step's final hidden states (each micro-batch through every stage)."""
        batches = split_micro_batches(step, self.micro_batches)
        self.group.step(PipelineStep(batches))
        outputs = [_stage_input(runner, batch) for batch in batches]
        # (Posted first: the last stage's sends never wait for this process.)
        last = self.size - 1
        receives = [dist.irecv(out, src=last, tag=i) for i, out in enumerate(outputs)]
        sends = []
        for i, batch in enumerate(batches):
            hidden = runner._hidden(batch, None).contiguous()
            sends.append((dist.isend(hidden, dst=1, tag=i), hidden))
        for work in receives:
            work.wait()
        for work, _ in sends:
            work.wait()
        self.num_steps += 1
        self.num_micro_batches += len(batches)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _stage_input(runner: Any, batch: StepInput) -> torch.Tensor:
    """A buffer for a micro-batch's hidden states between stages."""
    shape = (len(batch.token_ids), runner.hidden_size)
    return torch.empty(shape, dtype=runner.hidden_dtype, device=runner.device)


def follow_stage(runner: Any, step: PipelineStep, rank: int, size: int) -> None:
    """Stage ``rank``'s part of a step (``rank`` > 0): each micro-batch's hidden states
    from the previous stage through this stage's layers, on to the next stage (stage 0
    after the last)."""
    sends = []
    for i, batch in enumerate(step.micro_batches):
        incoming = _stage_input(runner, batch)
        dist.recv(incoming, src=rank - 1, tag=i)
        hidden = runner._hidden(batch, None, incoming).contiguous()
        sends.append((dist.isend(hidden, dst=(rank + 1) % size, tag=i), hidden))
    for work, _ in sends:
        work.wait()
