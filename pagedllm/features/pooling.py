"""Pooling (``--task embed/classify/score/reward``) in the step: a pooling request's prompt
runs once, whole, and the request is done when its pooled result comes out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.interfaces.extension import StepExtension, StepOutcome

if TYPE_CHECKING:
    from pagedllm.core.step_data import RunnerOutput, SchedulerOutput

_DONE = StepOutcome([], finished=True)


class PoolingExtension(StepExtension):
    """A request's state: its ``PoolingParams``."""

    name = "pooling"

    @classmethod
    def from_engine(cls, engine: Any) -> PoolingExtension | None:
        return cls() if engine.is_pooling else None

    def read_outputs(self, output: SchedulerOutput, result: RunnerOutput) -> dict[str, StepOutcome]:
        return dict.fromkeys(result.pooled, _DONE) if result.pooled else {}
