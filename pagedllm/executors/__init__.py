"""Executors: how an engine's ranks run (``--distributed-executor-backend``).

:mod:`~pagedllm.executors.base` holds the :class:`Executor` contract; ``uni`` runs the one
rank in the engine's process (:mod:`~pagedllm.executors.uni`), ``mp`` adds worker
processes (:mod:`~pagedllm.executors.mp`), ``ray`` Ray actors
(:mod:`~pagedllm.executors.ray`). Every rank, rank 0 included, is a
:class:`~pagedllm.executors.worker.Worker`; :mod:`~pagedllm.executors.pipeline` drives
pipeline stages. This module is the built-in plugin that registers them.
"""

from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.interfaces.executor import Executor

__all__ = ["Executor"]


@hookimpl
def pagedllm_register_executors(registry):
    registry.add("uni", "pagedllm.executors.uni:UniProcExecutor")
    registry.add("mp", "pagedllm.executors.mp:MultiprocExecutor")
    registry.add("ray", "pagedllm.executors.ray:RayDistributedExecutor")
