"""LoRA in the step: a request's adapter is loaded (and validated) when it comes, its KV
has its own prefix cache, and the running batch holds at most ``--max-loras`` adapters."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.interfaces.extension import StepExtension
from pagedllm.core.request import Request


class LoRAExtension(StepExtension):
    """A request's state: its ``LoRARequest``."""

    name = "lora"

    def __init__(self, manager: Any, max_loras: int | None) -> None:
        super().__init__()
        self.manager = manager
        self.max_loras = max_loras
        # Unfinished requests' adapter ids (the manager keeps those adapters loaded).
        self._live: dict[str, int] = {}
        # The adapters of this step's running batch.
        self._batch: set[int] = set()

    @classmethod
    def from_engine(cls, engine: Any) -> LoRAExtension | None:
        if engine.config.lora_config is None:
            return None
        extension = cls(engine.lora, engine.config.lora_config.max_loras)
        if engine.lora is not None:
            engine.lora.in_use = extension.adapters_in_use
        return extension

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        return InvalidRequestError(
            "lora_request", "this engine serves no LoRA adapters: start it with --enable-lora"
        )

    def adapters_in_use(self) -> set[int]:
        """The adapter ids of the unfinished requests."""
        return set(self._live.values())

    def new_request(self, request: Request) -> None:
        lora = request.features.get(self.name)
        if lora is None:
            return
        self.manager.adapter(lora)  # (loaded now: a bad adapter fails its request)
        # An adapter's KV differs from the base model's: its own prefix cache.
        request.cache_salt = f"lora:{lora.lora_int_id}"

    def add_request(self, request: Request) -> None:
        self._live[request.request_id] = request.features[self.name].lora_int_id

    def request_finished(self, request: Request) -> None:
        self._live.pop(request.request_id, None)

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
