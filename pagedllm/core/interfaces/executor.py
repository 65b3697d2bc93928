"""Executors: how the engine's ranks run (``--distributed-executor-backend``).

The engine schedules and owns the requests; an executor owns the ranks that compute the
model (one process, worker processes, Ray actors...). The engine drives it in this order,
once each but for :meth:`Executor.execute` (every step) and :meth:`Executor.shutdown`
(any time, also after a failure part way through)::

    executor = cls(config, pm)        # start the ranks (nothing loaded yet)
    loaded = executor.load_model()    # every rank builds its part of the model
    executor.profile(...)             # (devices that measure memory) the largest step
    executor.init_cache(...)          # every rank allocates its KV cache
    executor.execute(output, mask)    # each step (or submit, then collect: see below)
    executor.sleep(level), executor.wake_up(tags)   # (--enable-sleep-mode) between steps
    executor.shutdown()

An executor that can compute several steps at once (pipeline stages: stage 0 computes
the next step while the later stages run the previous one) says how many in
:attr:`Executor.steps_in_flight`; the engine then starts steps with
:meth:`Executor.submit` and takes their results, oldest first, with
:meth:`Executor.collect`, each step's requests disjoint from the other steps' in flight.

Rank 0 is in the engine's process with every built-in executor: what the engine reads
from the model (tokenizer, config, pooling heads) comes from :meth:`load_model`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.kv_cache.spec import KVCacheSpec
    from pagedllm.core.model_setup import LoadedModel
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.runner import ModelRunner
    from pagedllm.core.step_data import RunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """The ranks of one engine. A subclass is registered under a name (the hook
    ``pagedllm_register_executors``) or named by its class path on the command line."""

    # Whether it runs one rank only (then --tensor-parallel-size and
    # --pipeline-parallel-size above 1 are refused with it).
    single_process: ClassVar[bool] = False

    def __init__(self, config: PagedLLMConfig, pm: PluginManager) -> None:
        """Check that the ranks can run (before any model loads) and start them."""
        self.config = config
        self.pm = pm
        # The adapters' manager (with --enable-lora; set by load_model) and each rank's
        # weight-loading (start, end) wall-clock times, rank 0 first.
        self.lora: Any = None
        self.rank_loading: list[tuple[float, float]] = []
        # Rank 0's model runner (set by init_cache).
        self.runner: ModelRunner | None = None

    @property
    def num_ranks(self) -> int:
        """The ranks: tensor-parallel ranks times pipeline stages."""
        parallel = self.config.parallel_config
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    def kv_cache_layout(self, loaded: LoadedModel) -> tuple[KVCacheSpec, int]:
        """Rank 0's KV cache (its share of the KV heads, its pipeline stage's layers) and
        the bytes of one block on the rank holding the most, for which the number of
        blocks (the same on every rank) is sized: the last stage, which takes the
        remainder of the layers."""
        import dataclasses

        from pagedllm.core.kv_cache.spec import kv_cache_spec, kv_cache_torch_dtype
        from pagedllm.distributed.parallel_state import stage_layers

        parallel = self.config.parallel_config
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        num_layers = loaded.text_config.num_hidden_layers
        stage = stage_layers(num_layers) if pp > 1 else None
        dtype = kv_cache_torch_dtype(self.config.cache_config, loaded.dtype)
        spec = kv_cache_spec(loaded.text_config, dtype, tp, stage, loaded.model)
        deepest = spec
        if pp > 1:
            deepest = dataclasses.replace(spec, layers=stage_layers(num_layers, pp - 1, pp))
        return spec, deepest.bytes_per_block(self.config.cache_config.block_size)

    @abc.abstractmethod
    def load_model(self) -> LoadedModel:
        """Build every rank's part of the model (loaded, compiled, LoRA slots, attention
        backend, KV scales) and return rank 0's."""

    @abc.abstractmethod
    def profile(self, spec: KVCacheSpec, **step: Any) -> int:
        """Compute the largest step (``step``: :func:`~pagedllm.core.runner.profile_step`'s
        sizes) on every rank that takes part in rank 0's; the bytes of rank 0's throwaway
        KV cache. Called within ``Device.measure_peak_memory``."""

    @abc.abstractmethod
    def init_cache(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        extensions: dict[str, Any],
        graphs: bool,
    ) -> ModelRunner:
        """Allocate every rank's KV cache (``num_blocks`` blocks of ``spec``: rank 0's
        layers) and build its runner, with the runner side of each step extension
        (``extensions``: name -> its ``runner_payload()``, which every rank gets); rank 0's
        runner. ``graphs``: replay decode steps from the device's graphs (one more block,
        for padding rows)."""

    @abc.abstractmethod
    def execute(self, output: SchedulerOutput, token_mask: torch.Tensor | None) -> RunnerOutput:
        """Compute one scheduled step on every rank; rank 0's results. Raises
        :class:`~pagedllm.core.errors.EngineDeadError` when the engine cannot go on (a
        rank died or fell out of step); any other exception fails this step's requests
        only."""

    @property
    def steps_in_flight(self) -> int:
        """How many steps :meth:`submit` may have started before the oldest is collected
        (1: each step is computed within :meth:`submit`)."""
        return 1

    def submit(self, output: SchedulerOutput, token_mask: torch.Tensor | None) -> Any:
        """Start computing one scheduled step; :meth:`collect` of what this returns gives
        its results. Steps are collected in the order they were submitted, and every rank
        computes them in that order (so a step may read KV blocks an earlier step in
        flight writes). Raises as :meth:`execute` does. By default the step is computed
        here."""
        return self.execute(output, token_mask)

    def collect(self, handle: Any) -> RunnerOutput:
        """The results of the step :meth:`submit` returned ``handle`` for (waiting for
        it); raises as :meth:`execute` does."""
        return handle

    def save_sharded_state(self, output: Any, pattern: str | None, max_size: int | None) -> None:
        """``LLM.save_sharded_state``: every rank saves its part of the parameters in the
        directory ``output``. Not every executor can."""
        from pagedllm.core.errors import ConfigError

        raise ConfigError(f"save_sharded_state: {type(self).__name__} does not save ranks")

    def sleep(self, level: int) -> None:
        """``--enable-sleep-mode``: every rank releases its weights and KV cache
        (:mod:`pagedllm.core.sleep`; ``level`` 1 or 2). Not every executor can."""
        from pagedllm.core.errors import ConfigError

        raise ConfigError(f"--enable-sleep-mode: {type(self).__name__} cannot put ranks to sleep")

    def wake_up(self, tags: list[str] | None) -> None:
        """Every rank brings back what ``tags`` name (weights, kv_cache; None: both)."""
        from pagedllm.core.errors import ConfigError

        raise ConfigError(f"--enable-sleep-mode: {type(self).__name__} cannot wake ranks")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free the KV caches and stop the ranks; safe to call twice and after a failed
        start."""


def executor_class(backend: str, pm: PluginManager) -> type[Executor]:
    """The executor of ``--distributed-executor-backend``: a registered name, or a class
    path (:func:`import_executor_class`)."""
    if backend in pm.choices("executors"):
        return pm.load("executors", backend)
    return import_executor_class(backend)


def import_executor_class(path: str) -> type[Executor]:
    """The :class:`Executor` subclass at ``package.module.Class`` or
    ``package.module:Class`` (as vLLM's ``--distributed-executor-backend`` takes)."""
    from pagedllm.core.errors import ConfigError
    from pagedllm.core.registry import import_target

    target = path
    if ":" not in path and "." in path:
        module, _, name = path.rpartition(".")
        target = f"{module}:{name}"
    flag = f"--distributed-executor-backend {path}"
    try:
        cls = import_target(target)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"{flag}: cannot import the executor class ({exc}); give a registered name or "
            "the class path of an Executor subclass (package.module.Class)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ConfigError(
            f"{flag}: {cls!r} is not a subclass of pagedllm.executors.Executor "
            "(pagedllm.core.interfaces.executor.Executor)"
        )
    return cls
