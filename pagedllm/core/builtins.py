"""pagedllm's own core plugin: the built-in scheduler (``--scheduler-cls default``)."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_schedulers(registry):
    registry.add("default", "pagedllm.core.scheduler:Scheduler")
