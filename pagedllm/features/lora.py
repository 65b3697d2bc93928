"""LoRA as a step extension: a request's adapter is loaded (and validated) when it comes,
its KV has its own prefix cache, the running batch holds at most ``--max-loras`` adapters,
and each step the runner gives every adapter a slot and its requests' rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension
from pagedllm.core.request import Request

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from pagedllm.core.step_data import SchedulerOutput


class LoRAExtension(StepExtension):
    """On with ``--enable-lora``. A request's state: its ``LoRARequest``
    (``add_request(..., lora_request=...)``)."""

    name = "lora"
    request_arg = "lora_request"
    # (a replayed decode graph would skip the adapters)
    allows_decode_graphs = False

    def __init__(self, manager: Any, max_loras: int | None) -> None:
        super().__init__()
        # Rank 0's adapters (pagedllm.lora.manager.LoRAManager): loads and keeps them.
        self.manager = manager
        self.max_loras = max_loras
        # Unfinished requests' adapter ids (the manager keeps those adapters loaded).
        self._live: dict[str, int] = {}
        # The adapters of this step's running batch.
        self._batch: set[int] = set()

    @classmethod
    def from_engine(cls, engine: Any) -> LoRAExtension | None:
        lora = engine.config.lora_config
        if lora is None:
            return None
        return cls(engine.executor.lora, lora.max_loras)

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        return InvalidRequestError(
            "lora_request", "this engine serves no LoRA adapters: start it with --enable-lora"
        )

    def runner_payload(self) -> Any:
        return True  # (each rank's runner drives that rank's adapter slots)

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> LoRARunner:
        return LoRARunner(worker.lora)

    def new_request(self, request: Request) -> None:
        lora = request.features.get(self.name)
        if lora is None:
            return
        self.manager.adapter(lora)  # (loaded now: a bad adapter fails its request)
        # An adapter's KV differs from the base model's: its own prefix cache.
        request.cache_salt = f"lora:{lora.lora_int_id}"

    def add_request(self, request: Request) -> None:
        lora_id = request.features[self.name].lora_int_id
        self._live[request.request_id] = lora_id
        self.manager.hold(lora_id)

    def request_finished(self, request: Request) -> None:
        lora_id = self._live.pop(request.request_id, None)
        if lora_id is not None:
            self.manager.release(lora_id)

    def begin_step(self, running: list[Request]) -> list[tuple[Request, BaseException]]:
        name = self.name
        self._batch = {r.features[name].lora_int_id for r in running if name in r.features}
        return []

    def admit(self, request: Request) -> bool:
        """Whether its adapter fits beside the batch's (else it waits for a slot)."""
        if self.max_loras is None:
            return True
        lora_id = request.features[self.name].lora_int_id
        return lora_id in self._batch or len(self._batch) < self.max_loras

    def admitted(self, request: Request) -> None:
        self._batch.add(request.features[self.name].lora_int_id)


class LoRARunner(RunnerExtension):
    """The runner's side on every rank: rank 0 gives the step's adapters slots (the
    fills and each request's slot go to the other ranks with the step); a rank that
    did not build the step (or a pipeline's micro-batch) follows them."""

    name = "lora"

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def step_input(self, output: SchedulerOutput) -> Any:
        name = self.name
        self.manager.set_step(
            [(item.request.features.get(name), item.num_new_tokens) for item in output.scheduled]
        )
        # (fills, each request's slot): empty slots when no request has an adapter
        return self.manager.step_fills, self.manager.step_slots

    def before_forward(self, step: Any, data: Any, built_here: bool) -> None:
        if built_here:
            return  # (set_step set this rank's adapters for the step)
        fills, slots = data if data is not None else ([], [])
        if fills is self.manager.step_fills:
            fills = []  # (rank 0's micro-batch: it filled these slots when it built the step)
        self.manager.follow_step(fills, slots, step.query_lens)

    def split(self, data: Any, requests: slice, tokens: slice, first: bool) -> Any:
        fills, slots = data
        # (rank 0 filled its slots when it built the step; the fills go with the first)
        return (fills if first else [], slots[requests])

    def after_micro_batches(self, step: Any, data: Any) -> None:
        """The step's adapters by row again: the vocabulary head's adapter applies to rows
        of every micro-batch."""
        slots = [] if data is None else data[1]
        self.manager.follow_step([], slots, step.query_lens)

    def logits_rows(self, rows: torch.Tensor) -> AbstractContextManager[None]:
        return self.manager.rows(rows)
