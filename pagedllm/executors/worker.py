"""One rank of an engine, rank 0 included: :class:`Worker` builds its part of the model in
one sequence, sizes and allocates its KV cache, and computes its part of each step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

logger = logging.getLogger(__name__)


def collective_backend(device_name: str) -> str:
    """The ``torch.distributed`` backend for a device: NCCL between GPUs, gloo else."""
    return "nccl" if device_name == "cuda" else "gloo"


def rank_name(config: Any, rank: int) -> str:
    """How errors name worker ``rank``: a tensor-parallel rank, a pipeline stage, or a
    tensor-parallel rank of a stage."""
    parallel = config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp == 1:
        return f"tensor-parallel worker rank {rank}"
    if tp == 1:
        return f"pipeline stage {rank}"
    return f"pipeline stage {rank // tp} (its tensor-parallel rank {rank % tp})"


@dataclasses.dataclass(frozen=True, slots=True)
class RankLoaded:
    """What a rank reports once built: the (input, output) sizes of the layers an
    adapter may target (None without --enable-lora), which rank 0 checks adapters
    against (a pipeline stage holds layers it does not), and when it loaded its weights
    (wall-clock start and end)."""

    lora_layers: dict[str, tuple[int, int]] | None
    loading: tuple[float, float]


@contextlib.contextmanager
def loading_turn(gate: Any) -> Iterator[list[float]]:
    """Within: this rank loads its weights, once ``gate`` (a semaphore shared by the
    ranks, --max-parallel-loading-workers; None: no limit) lets it; yields the
    ``[start, end]`` wall-clock times, filled on the way out."""
    times: list[float] = []
    with gate if gate is not None else contextlib.nullcontext():
        times.append(time.time())
        try:
            yield times
        finally:
            times.append(time.time())


def _warn_if_no_experts_split(model: Any, tp: int) -> None:
    """--enable-expert-parallel changes nothing without several ranks or experts: say so
    (as vLLM, it is accepted)."""
    from pagedllm.core.layers.moe import FusedMoE

    if tp == 1:
        logger.warning(
            "--enable-expert-parallel with one tensor-parallel rank: every expert stays on "
            "it (use --tensor-parallel-size N to split the experts over N ranks)"
        )
    elif not any(isinstance(module, FusedMoE) for module in model.modules()):
        logger.warning(
            "--enable-expert-parallel: %s has no mixture-of-experts layers, so there are "
            "no experts to split; its layers are split by --tensor-parallel-size as usual",
            type(model).__name__,
        )


class Worker:
    """One rank of ``size`` (a tensor-parallel rank, a pipeline stage, or the only one):
    :meth:`join` enters the ranks' group (several ranks), :meth:`load` builds this rank's
    part, :meth:`profile` computes the largest step, :meth:`init_cache` allocates the KV
    cache and builds the runner, :meth:`follow` computes a rank above 0's part of a step
    (rank 0's executor drives its runner). ``cores``: the CPUs the ranks on this machine
    share (by default the device's thread count); ``load_gate``: the semaphore of
    --max-parallel-loading-workers."""

    def __init__(
        self,
        config: Any,
        rank: int = 0,
        size: int = 1,
        init_method: str | None = None,
        cores: int | None = None,
        load_gate: Any = None,
        pm: Any = None,
    ) -> None:
        self.config, self.rank, self.size, self.init_method = config, rank, size, init_method
        self.cores = cores
        self.load_gate = load_gate
        self.pm = pm
        parallel = config.parallel_config
        self.pipeline = parallel.pipeline_parallel_size > 1
        self.loaded: Any = None
        self.backend: Any = None
        self.lora: Any = None  # (with --enable-lora: the adapters' slots)
        self.runner: Any = None
        self.stage_io: Any = None  # (pipeline parallelism: the hidden states between stages)
        self.sleeping: Any = None  # (--enable-sleep-mode: a RankSleep while asleep)
        # (--enable-sleep-mode: the model's storages as loaded, which a reload builds again)
        self.reloadable: set[str] = set()

    def join(self) -> None:
        """Enter the group of the ``size`` ranks at ``init_method``."""
        device = self.config.device_config.device
        if device.name == "cuda" and self.rank > 0:
            torch.cuda.set_device(self.rank)
        parallel = self.config.parallel_config
        init_distributed(
            self.rank,
            parallel.tensor_parallel_size,
            self.init_method,
            collective_backend(device.name),
            stages=parallel.pipeline_parallel_size,
            experts=parallel.enable_expert_parallel,
        )

    def load(self) -> RankLoaded:
        """Build this rank's part, in this order on every rank: load the weights (in
        turn), expert-parallel checks, compile, LoRA slots (before the KV cache is sized
        from the memory left), the attention backend, the KV cache's scales."""
        from pagedllm.core.args.validate import attention_backend_name
        from pagedllm.core.attention.layer import set_kv_scales
        from pagedllm.core.compilation import compile_model
        from pagedllm.core.kv_cache.spec import kv_cache_torch_dtype
        from pagedllm.core.model_setup import load_model
        from pagedllm.core.plugins import make_plugin_manager

        config = self.config
        device = config.device_config.device
        if self.pm is None:
            self.pm = make_plugin_manager()
        pm = self.pm
        with loading_turn(self.load_gate) as loading:
            self.loaded = loaded = load_model(config, pm)
        if config.model_config.enable_sleep_mode:
            from pagedllm.core.sleep import named_storages

            self.reloadable = set(named_storages(loaded.model))
        if self.size > 1:  # (the ranks share the machine's cores)
            cores = device.num_threads() if self.cores is None else self.cores
            torch.set_num_threads(max(1, cores // self.size))
        parallel = config.parallel_config
        if parallel.enable_expert_parallel and self.rank == 0:
            _warn_if_no_experts_split(loaded.model, parallel.tensor_parallel_size)
        compile_model(loaded.model, config.compilation_config.level)
        if config.lora_config is not None:
            from pagedllm.lora.manager import make_lora_manager

            self.lora = make_lora_manager(
                loaded.model, config.lora_config, loaded.dtype, config.device_config.torch_device
            )
        self.backend = pm.load("attention_backends", attention_backend_name(device, pm))()
        cache = config.cache_config
        set_kv_scales(loaded.model, cache, kv_cache_torch_dtype(cache, loaded.dtype))
        if self.pipeline:
            from pagedllm.executors.pipeline import StageIO

            self.stage_io = StageIO.of(loaded)
        lora_layers = None if self.lora is None else dict(self.lora.sizes)
        return RankLoaded(lora_layers, (loading[0], loading[1]))

    def profile(self, payload: dict[str, Any]) -> int:
        """Compute the largest step (``payload``: :func:`~pagedllm.core.runner.profile_step`'s
        arguments but the model, the backend and the device; under ``extensions``, each
        step extension's ``profile_payload`` by name, computed first); the throwaway
        cache's bytes. A later pipeline stage does nothing (rank 0 profiles stage 0 with its
        tensor-parallel ranks alone)."""
        from pagedllm.core.runner import profile_step
        from pagedllm.distributed.parallel_state import pipeline_parallel

        payload = dict(payload)
        extensions = payload.pop("extensions", None) or {}
        if self.pipeline and pipeline_parallel().rank > 0:
            return 0
        device = self.config.device_config.torch_device
        with torch.inference_mode():
            held = [
                self.pm.load("step_extensions", name).profile_on_rank(data, self)
                for name, data in extensions.items()
            ]
        excluded = profile_step(self.loaded.model, self.backend, device=device, **payload)
        del held
        return excluded

    def init_cache(
        self,
        spec: Any,
        num_blocks: int,
        extensions: dict[str, Any] | None = None,
        graphs: bool = False,
    ) -> Any:
        """Allocate the KV cache (``spec``: rank 0's; a later pipeline stage holds its own
        layers) and build the runner (``extensions``: each step extension's runner
        payload, by name; ``graphs``: replaying decode steps from the device's graphs,
        with one more block for their padding rows); the runner."""
        from pagedllm.core.runner import ModelRunner

        if self.pipeline:
            from pagedllm.distributed.parallel_state import stage_layers

            spec = dataclasses.replace(spec, layers=stage_layers(spec.num_layers))
        config = self.config
        device = config.device_config.device
        decode_graphs = None
        if graphs:

            def decode_graphs(runner: Any) -> Any:
                return device.decode_graphs(runner, config)

        self.runner = ModelRunner(
            self.loaded.model,
            spec,
            num_blocks,
            config.cache_config.block_size,
            self.loaded.text_config.vocab_size,
            config.device_config.torch_device,
            self.backend,
            reserved_blocks=int(graphs),
            batch_invariant=config.model_config.batch_invariant,
            extensions=[
                self.pm.load("step_extensions", name).make_runner_extension(payload, self)
                for name, payload in (extensions or {}).items()
            ],
            decode_graphs=decode_graphs,
            time_steps=config.observability_config.collect_detailed_traces is not None,
        )
        return self.runner

    def follow(self, step: Any) -> None:
        """A rank above 0's part of a step rank 0 built (a ``StepInput``, or with
        pipeline stages a ``PipelineStep``)."""
        if self.pipeline:
            from pagedllm.executors.pipeline import follow

            follow(self.runner, self.stage_io, step)
        else:
            self.runner.follow(step)

    def sleep(self, level: int) -> int:
        """Release this rank's weights and KV cache (:mod:`pagedllm.core.sleep`); the
        bytes released."""
        from pagedllm.core.errors import ConfigError
        from pagedllm.core.sleep import RankSleep, check_sleep_level

        level = check_sleep_level(level)
        if self.sleeping is not None:
            return 0
        if level == 2 and self.lora is not None:
            raise ConfigError(
                "sleep level 2 with --enable-lora is not supported: reloading the model from "
                "its checkpoint would not restore the adapters' slots; use level 1"
            )
        device = self.config.device_config.device
        sleeping = RankSleep(
            device, self.loaded.model, self.runner.kv_caches, self._reload, self.reloadable
        )
        released = sleeping.sleep(level)
        self.sleeping = sleeping
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` released (``tags``: weights, kv_cache; None:
        both)."""
        if self.sleeping is None:
            return
        self.sleeping.wake_up(tags)
        if not self.sleeping.asleep:
            import gc

            self.sleeping = None
            gc.collect()  # (a level-2 wake's second model, built and dropped)
            self.config.device_config.device.release_startup_memory()

    def _reload(self) -> Any:
        """This rank's part of the model built again from its checkpoint, as :meth:`load`
        builds it (the weights and the KV cache's scales; compiling and the adapters'
        slots change no tensor of it)."""
        from pagedllm.core.attention.layer import set_kv_scales
        from pagedllm.core.kv_cache.spec import kv_cache_torch_dtype
        from pagedllm.core.model_setup import load_model

        threads = torch.get_num_threads()  # (loading resets it)
        try:
            loaded = load_model(self.config, self.pm)
        finally:
            torch.set_num_threads(threads)
        cache = self.config.cache_config
        set_kv_scales(loaded.model, cache, kv_cache_torch_dtype(cache, loaded.dtype))
        return loaded.model

    def free_cache(self) -> None:
        """Close the step extensions' runner sides and drop the KV cache (the engine is
        shutting down)."""
        if self.runner is not None:
            for extension in self.runner.extensions:
                extension.close()
            self.runner.kv_caches.clear()

    def leave(self) -> None:
        """Leave the ranks' group (no-op outside one)."""
        destroy_distributed()
