"""Tensor-parallel workers as Ray actors (``--distributed-executor-backend ray``).

The same division of work as the ``mp`` backend (:mod:`pagedllm.distributed.executor`):
the engine's process is rank 0, ranks 1 to N - 1 follow its steps. Here each of them is
a Ray actor, placed by a placement group of one bundle per rank (a CPU, or a GPU on the
cuda device), so the ranks may be on several machines of a Ray cluster: the engine
connects to the cluster at ``RAY_ADDRESS`` (``ray start --head`` on one machine, ``ray
start --address HEAD:6379`` on the others), or starts a Ray instance on this machine
when none is given. The ranks meet in a ``torch.distributed`` group at rank 0's address.

Per step, rank 0 calls each actor's ``follow`` without waiting (Ray runs one caller's
calls to an actor in order); a dead actor makes the engine fail loudly, as with ``mp``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from pagedllm.core.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'"
        ) from None
    return ray


class _Rank:
    """A worker rank inside a Ray actor (the methods rank 0 calls)."""

    def __init__(self, config: Any, rank: int, size: int, init_method: str) -> None:
        self.config, self.rank, self.size, self.init_method = config, rank, size, init_method
        self.loaded: Any = None
        self.runner: Any = None

    def load(self) -> str:
        import torch

        from pagedllm.core.args.validate import attention_backend_name
        from pagedllm.core.compilation import compile_model
        from pagedllm.core.model_setup import load_model
        from pagedllm.core.plugins import make_plugin_manager
        from pagedllm.distributed.executor import collective_backend
        from pagedllm.distributed.parallel_state import init_distributed

        config = self.config
        device = config.device_config.device
        if device.name == "cuda":
            torch.cuda.set_device(0)  # (Ray shows each actor its own GPU)
        init_distributed(self.rank, self.size, self.init_method, collective_backend(device.name))
        # (Ray gives a one-CPU actor one thread; the ranks share the node's cores.)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.size))
        pm = make_plugin_manager()
        self.loaded = load_model(config, pm)
        compile_model(self.loaded.model, config.compilation_config.level)
        self.backend = pm.load("attention_backends", attention_backend_name(device, pm))()
        return "loaded"

    def profile(self, payload: tuple[Any, ...]) -> None:
        from pagedllm.core.runner import profile_step

        spec, block_size, tokens, seqs, max_len = payload
        profile_step(
            self.loaded.model, self.backend, spec, block_size, tokens, seqs,
            self.config.device_config.torch_device, max_len,
        )  # fmt: skip

    def cache(self, payload: tuple[Any, ...]) -> str:
        from pagedllm.core.runner import ModelRunner, set_kv_scales

        spec, num_blocks, block_size, vocab_size = payload
        set_kv_scales(self.loaded.model, self.config.cache_config, spec.dtype)
        self.runner = ModelRunner(
            self.loaded.model, spec, num_blocks, block_size, vocab_size,
            self.config.device_config.torch_device, self.backend,
        )  # fmt: skip
        self.runner.sampler = None  # (rank 0 samples)
        return "ready"

    def follow(self, step: Any) -> None:
        try:
            self.runner.follow(step)
        except BaseException:
            # (Exit, so that rank 0's collective fails now rather than at its timeout.)
            logger.exception("tensor-parallel rank %d failed", self.rank)
            os._exit(1)

    def stop(self) -> None:
        from pagedllm.distributed.parallel_state import destroy_distributed

        destroy_distributed()


class RayWorkerGroup:
    """Ranks 1 to ``size - 1`` as Ray actors (see the module docstring); the interface
    of :class:`~pagedllm.distributed.executor.WorkerGroup`."""

    def __init__(self, config: Any, size: int) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.size = size
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        self.init_method = f"tcp://{host}:{port}"
        gpu = config.device_config.device.name == "cuda"
        if gpu:
            # (Rank 0's GPU would have to be in the placement group too, so that Ray does
            # not give an actor the GPU this process uses: not built yet.)
            raise ConfigError(
                "--distributed-executor-backend ray is not supported on the cuda device yet; use mp"
            )
        bundle = {"CPU": 1}
        self.group = placement_group([bundle] * (size - 1))
        try:
            ray.get(self.group.ready(), timeout=120)
        except Exception as exc:
            ray.util.remove_placement_group(self.group)
            raise ConfigError(
                f"--distributed-executor-backend ray: the Ray cluster has no room for "
                f"{size - 1} worker(s) of {bundle}: {exc}"
            ) from exc
        actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)(_Rank)
        self.actors = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=rank - 1
                ),
                name=None,
            ).remote(config, rank, size, self.init_method)
            for rank in range(1, size)
        ]
        self._pending: dict[str, list[Any]] = {}
        self._last: list[Any] = []
        self._closed = False
        self._pending["loaded"] = [a.load.remote() for a in self.actors]

    @property
    def procs(self) -> list[Any]:
        return self.actors

    def wait(self, what: str, timeout: float = 600.0) -> None:
        refs = self._pending.pop(what, [])
        try:
            self.ray.get(refs, timeout=timeout)
        except Exception as exc:
            raise ConfigError(f"a tensor-parallel Ray worker failed: {exc}") from exc

    def send(self, kind: str, payload: Any = None) -> None:
        method = {"profile": "profile", "cache": "cache", "step": "follow"}[kind]
        refs = [getattr(a, method).remote(payload) for a in self.actors]
        if kind == "cache":
            self._pending["ready"] = refs
        else:
            self._last = refs

    def step(self, step: Any) -> None:
        self.send("step", step)

    def check(self, exc: BaseException) -> BaseException:
        """EngineDeadError when an actor died (its last call failed), else ``exc``."""
        ready, _ = self.ray.wait(self._last, num_returns=len(self._last), timeout=5)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception as error:
                return EngineDeadError(f"a tensor-parallel Ray worker failed: {error}")
        return exc

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.ray.get([a.stop.remote() for a in self.actors], timeout=10)
        except Exception:
            pass
        for a in self.actors:
            self.ray.kill(a)
        time.sleep(0)  # (the actors' processes exit asynchronously)
        self.ray.util.remove_placement_group(self.group)
