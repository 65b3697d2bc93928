"""``--distributed-executor-backend uni``: the engine's process is the only rank."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.executors.base import Executor
from pagedllm.executors.worker import Worker


class UniProcExecutor(Executor):
    """One :class:`~pagedllm.executors.worker.Worker`, rank 0, in this process."""

    single_process = True

    def __init__(self, config: Any, pm: Any) -> None:
        super().__init__(config, pm)
        ranks = self.num_ranks
        if self.single_process and ranks > 1:
            backend = config.parallel_config.distributed_executor_backend
            raise ConfigError(
                f"--distributed-executor-backend {backend} runs one process, which cannot "
                f"hold {ranks} ranks; use mp"
            )
        self.worker = Worker(config, pm=pm)

    def load_model(self) -> Any:
        self.worker.load()
        self.lora = self.worker.lora
        return self.worker.loaded

    def profile(self, spec: Any, **step: Any) -> int:
        return self.worker.profile(dict(spec=spec, **step))

    def init_cache(
        self, spec: Any, num_blocks: int, *, extensions: dict[str, Any], graphs: bool
    ) -> Any:
        self.runner = self.worker.init_cache(spec, num_blocks, extensions, graphs)
        return self.runner

    def execute(self, output: Any, token_mask: Any) -> Any:
        return self.runner.execute(output, token_mask)

    def save_sharded_state(self, output: Any, pattern: str | None, max_size: int | None) -> None:
        from pathlib import Path

        from pagedllm.plugins.loaders.sharded_state import save_rank_state

        save_rank_state(self.config, self.pm, Path(output), pattern, max_size)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.worker.wake_up(tags)

    def shutdown(self) -> None:
        self.worker.free_cache()
