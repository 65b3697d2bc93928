"""What the executors share: the :class:`Executor` contract (defined with the engine's
interfaces, :mod:`pagedllm.core.interfaces.executor`) and the checks made before any
rank starts."""

from __future__ import annotations

import inspect
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.executor import Executor, executor_class

__all__ = ["Executor", "check_parallel_support", "executor_class"]


def check_parallel_support(config: Any, pm: Any) -> None:
    """Refuse, before any process starts, a missing model or an architecture that cannot
    be split over the ranks of -tp / -pp (/ --enable-expert-parallel)."""
    from pagedllm.core.loading import get_model_loader
    from pagedllm.core.model_setup import choose_implementation, load_hf_config

    parallel = config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    hf_config = load_hf_config(config, get_model_loader(config.load_config, pm))
    _, name = choose_implementation(
        list(getattr(hf_config, "architectures", None) or []),
        config.model_config.model_impl,
        pm.registry("models"),
    )
    architecture = pm.registry("models").load(name)
    if parallel.enable_expert_parallel:
        _check_expert_parallel(architecture, hf_config, tp)
    else:
        architecture.check_tensor_parallel(hf_config, tp)
    architecture.check_pipeline_parallel(hf_config, pp)


def _check_expert_parallel(architecture: Any, hf_config: Any, tp: int) -> None:
    """The architecture's tensor-parallel check with its experts split by expert; an
    architecture plugin whose check predates the ``experts`` keyword is refused."""
    if "experts" not in inspect.signature(architecture.check_tensor_parallel).parameters:
        raise ConfigError(
            f"{architecture.__name__} does not support --enable-expert-parallel (its "
            "check_tensor_parallel takes no experts keyword); leave the flag out"
        )
    architecture.check_tensor_parallel(hf_config, tp, experts=True)
