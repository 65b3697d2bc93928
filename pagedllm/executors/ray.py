"""Tensor-parallel workers as Ray actors (``--distributed-executor-backend ray``,
:class:`RayDistributedExecutor`).

The same division of work as the ``mp`` backend (:mod:`pagedllm.executors.mp`):
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
from typing import Any

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.executors.mp import MultiprocExecutor, WorkerRank

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'"
        ) from None
    return ray


class RayRank(WorkerRank):
    """A rank as a Ray actor. Built inside the actor, where Ray gives a one-CPU actor one
    thread: the ranks share the node's cores by its CPU affinity. A failed step exits the
    actor, so that rank 0's collective fails now rather than at its timeout."""

    def __init__(self, config: Any, rank: int, size: int, init_method: str) -> None:
        super().__init__(config, rank, size, init_method, cores=len(os.sched_getaffinity(0)))

    def follow(self, step: Any) -> None:
        try:
            super().follow(step)
        except BaseException:
            logger.exception("rank %d failed", self.rank)
            os._exit(1)


class RayWorkerGroup:
    """Ranks 1 to ``size - 1`` as Ray actors (see the module docstring); the interface
    of :class:`~pagedllm.executors.mp.WorkerGroup`."""

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
        if config.device_config.device.name == "cuda":
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
        actor = ray.remote(num_cpus=1)(RayRank)
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

    def wait(self, what: str, timeout: float = 600.0) -> list[Any]:
        """Wait for every actor's ``what`` (``loaded``, ``ready``); what each said with
        it, by rank."""
        refs = self._pending.pop(what, [])
        try:
            answers = self.ray.get(refs, timeout=timeout)
        except Exception as exc:
            raise ConfigError(f"a Ray worker failed: {exc}") from exc
        return [answer[1] if isinstance(answer, tuple) else None for answer in answers]

    def send(self, kind: str, payload: Any = None) -> None:
        """Call each actor's ``kind`` (``profile``, ``cache``, ``follow``)."""
        refs = [getattr(a, kind).remote(payload) for a in self.actors]
        answer = {
            "cache": "ready",
            "save_sharded_state": "saved",
            "sleep": "done",
            "wake_up": "done",
        }.get(kind)
        if answer is not None:
            self._pending[answer] = refs
        else:
            self._last = refs

    def step(self, step: Any) -> None:
        self.send("follow", step)

    def check(self, exc: BaseException) -> BaseException:
        """EngineDeadError when an actor died (its last call failed), else ``exc``."""
        ready, _ = self.ray.wait(self._last, num_returns=len(self._last), timeout=5)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception as error:
                return EngineDeadError(f"a Ray worker failed: {error}")
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
        self.ray.util.remove_placement_group(self.group)


class RayDistributedExecutor(MultiprocExecutor):
    """Rank 0 in this process, ranks 1 to N - 1 as Ray actors (:class:`RayWorkerGroup`);
    with one rank, the uni executor (no Ray)."""

    def start_group(self) -> RayWorkerGroup:
        return RayWorkerGroup(self.config, self.size)
