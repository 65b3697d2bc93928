"""Pipeline parallelism (``-pp N``): the model's layers split over N processes (stages),
a step's requests split into micro-batches that are in flight on several stages at once.

Stage 0 is the engine's process: it schedules, embeds the tokens, runs its layers and,
at the end of the pipeline, computes the logits and samples. Stages 1 to N - 1 are the
worker processes of :mod:`pagedllm.executors.mp` (or Ray actors). Each step:

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

Steps in flight (:attr:`PipelineStages.steps_in_flight`): the engine may also start a
step before the previous one came back (its virtual engines, each with its own
requests): :meth:`PipelineStages.start` runs stage 0's layers and posts the receive of
the final hidden states, :meth:`PipelineStages.finish` waits for them. Each stage
computes the steps in the order stage 0 started them, so a step sees the KV blocks an
earlier step in flight writes; each step's transfers have their own tags. A step in
flight is one micro-batch: the overlap comes from the other steps.

With tensor parallelism too (``-tp T -pp N``), each stage is T ranks that split its
layers as ``-tp T`` does (collectives within the stage's group); each rank sends its
hidden states (the same on every rank of a stage) to its own rank in the next stage, and
stage 0's ranks compute the logits together.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.core.runner import ModelRunner, StepInput, split_step
from pagedllm.distributed.parallel_state import pipeline_parallel, return_group, stage_peer

# Each step's transfers are tagged tag + i (micro-batch i); tags cycle through this many
# steps, far more than are ever in flight at once.
TAG_STEPS = 1024
MAX_MICRO_BATCHES = 64


@dataclasses.dataclass(slots=True)
class PipelineStep:
    """What the other ranks take for a step: the step (its logits rows, which stage 0's
    tensor-parallel ranks compute together), its micro-batches, in order, and the tag
    of its first micro-batch's transfers."""

    step: StepInput
    micro_batches: list[StepInput]
    tag: int = 0


def split_micro_batches(
    step: StepInput, count: int, runner: ModelRunner | None = None
) -> list[StepInput]:
    """``step``'s requests in at most ``count`` contiguous runs of about equal tokens,
    each a :class:`StepInput` of its own (:func:`~pagedllm.core.runner.split_step`: no
    logits rows, stage 0 computes those on the gathered hidden states), with the step
    extensions' inputs of ``runner``'s split among them."""
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
    split = split_step if runner is None else runner.split_step
    return [
        split(step, slice(a, b), slice(tokens[a], tokens[b]), a == 0)
        for a, b in itertools.pairwise(cuts)
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class StageIO:
    """The hidden states between stages: their width (the model's hidden size), the
    width of the final ones (the head's input) and their type."""

    hidden_size: int
    output_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, loaded: Any) -> StageIO:
        """Of a loaded model (:class:`~pagedllm.core.model_setup.LoadedModel`)."""
        return cls(loaded.hf_config.hidden_size, loaded.model.head_input_size, loaded.dtype)


class PipelineStages:
    """Stage 0's side of the pipeline on rank 0: :meth:`split` makes a step's message to
    the other ranks, :meth:`start` runs it through stage 0 and on, :meth:`finish` takes
    its final hidden states back (other steps may start in between)."""

    def __init__(self, size: int, io: StageIO, tensor_parallel_size: int = 1) -> None:
        if size > MAX_MICRO_BATCHES:
            raise ValueError(f"at most {MAX_MICRO_BATCHES} pipeline stages, not {size}")
        # Micro-batches per step: one per stage keeps every stage busy once the pipeline
        # has filled, without cutting the batch into more small pieces than that.
        self.micro_batches = size
        # Steps that may be in flight: one per stage. (With tensor-parallel ranks in
        # stage 0, one: they follow rank 0's steps whole, the logits' collectives
        # included, so rank 0 could not compute a step's layers between another step's
        # layers and logits.)
        self.steps_in_flight = size if tensor_parallel_size == 1 else 1
        self.io = io
        self._tags = itertools.count()
        # Steps and micro-batches sent through the stages, and the steps started while
        # another was in flight (the tests read them).
        self.num_steps = 0
        self.num_micro_batches = 0
        self.num_overlapped = 0
        self._started = 0

    def split(
        self, runner: ModelRunner, step: StepInput, micro_batches: int | None = None
    ) -> PipelineStep:
        count = self.micro_batches if micro_batches is None else micro_batches
        tag = next(self._tags) % TAG_STEPS * MAX_MICRO_BATCHES
        return PipelineStep(step, split_micro_batches(step, count, runner), tag)

    def start(self, runner: ModelRunner, message: PipelineStep) -> InFlight:
        """Stage 0's layers on each micro-batch of the step, sent on to stage 1; the
        receives of its final hidden states are posted."""
        self.num_steps += 1
        self.num_micro_batches += len(message.micro_batches)
        self.num_overlapped += int(self._started > 0)
        self._started += 1
        return start_first_stage(runner, self.io, message)

    def finish(self, runner: ModelRunner, pending: InFlight) -> torch.Tensor:
        """The final hidden states of a step :meth:`start` started (waiting for them),
        the step extensions' state set for the whole step again."""
        self._started -= 1
        hidden = pending.wait()
        runner.after_micro_batches(pending.message.step)
        return hidden


def follow(runner: ModelRunner, io: StageIO, message: PipelineStep) -> None:
    """A rank above 0's part of a pipeline step: a later stage's layers on each
    micro-batch; a tensor-parallel rank of stage 0 runs the first stage as rank 0 does,
    then computes the logits with it."""
    with runner.step_mode():
        if pipeline_parallel().rank > 0:
            follow_stage(runner, io, message)
            return
        hidden = start_first_stage(runner, io, message).wait()
        runner.after_micro_batches(message.step)
        for rows in runner.row_blocks(message.step):
            if rows is not None:
                runner.logits(hidden, rows)


@dataclasses.dataclass(slots=True)
class InFlight:
    """A step stage 0 computed and sent on: the transfers still under way (the final
    hidden states' receives, the sends to stage 1) and their buffers."""

    message: PipelineStep
    outputs: list[torch.Tensor]
    receives: list[Any]
    sends: list[tuple[Any, torch.Tensor]]

    def wait(self) -> torch.Tensor:
        """The step's final hidden states, in step order, once every transfer is done."""
        for work in self.receives:
            work.wait()
        for work, _ in self.sends:
            work.wait()
        outputs = self.outputs
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def start_first_stage(runner: ModelRunner, io: StageIO, message: PipelineStep) -> InFlight:
    """A rank of stage 0 (rank 0, and its tensor-parallel ranks): each micro-batch
    through this stage's layers and on to stage 1; the receives of the final hidden
    states of every micro-batch from the last stage are posted (:meth:`InFlight.wait`)."""
    batches = message.micro_batches
    outputs = [_stage_input(runner, io, batch, io.output_size) for batch in batches]
    # (Posted first: the last stage's sends never wait for this process.)
    last = stage_peer(pipeline_parallel().size - 1)
    back = return_group()
    tag = message.tag
    receives = [dist.irecv(out, src=last, tag=tag + i, group=back) for i, out in enumerate(outputs)]
    sends = []
    for i, batch in enumerate(batches):
        hidden = runner.hidden_states(batch, built_here=False).contiguous()
        sends.append((dist.isend(hidden, dst=stage_peer(1), tag=tag + i), hidden))
    return InFlight(message, outputs, receives, sends)


def _stage_input(runner: ModelRunner, io: StageIO, batch: StepInput, width: int) -> torch.Tensor:
    """A buffer for a micro-batch's hidden states between stages (``width``: the
    model's hidden size; the final hidden states' may differ)."""
    shape = (len(batch.token_ids), width)
    return torch.empty(shape, dtype=io.dtype, device=runner.device)


def follow_stage(runner: ModelRunner, io: StageIO, message: PipelineStep) -> None:
    """A rank of a later stage's part of a step: each micro-batch's hidden states from
    the previous stage (its rank of the same tensor-parallel rank) through this stage's
    layers, on to the next stage (stage 0 after the last)."""
    stage = pipeline_parallel()
    source, target = stage_peer(stage.rank - 1), stage_peer((stage.rank + 1) % stage.size)
    group = return_group() if stage.last else None
    sends = []
    for i, batch in enumerate(message.micro_batches):
        tag = message.tag + i
        incoming = _stage_input(runner, io, batch, io.hidden_size)
        dist.recv(incoming, src=source, tag=tag)
        hidden = runner.hidden_states(batch, incoming, built_here=False)
        hidden = hidden.contiguous()
        sends.append((dist.isend(hidden, dst=target, tag=tag, group=group), hidden))
    for work, _ in sends:
        work.wait()
