"""Step extensions: what a feature adds to an engine step, beside the scheduler's loop
(the interface is :class:`pagedllm.core.interfaces.extension.StepExtension`).

Each is built by the engine from its configuration through the ``step_extensions``
registry, which this package fills with pagedllm's own.
"""

from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.interfaces.extension import StepExtension, StepOutcome

__all__ = ["StepExtension", "StepOutcome"]


@hookimpl
def pagedllm_register_step_extensions(registry):
    registry.add("guided", "pagedllm.features.guided:GuidedExtension")
    registry.add("kv_events", "pagedllm.features.kv_events:KVEventsExtension")
    registry.add("lora", "pagedllm.features.lora:LoRAExtension")
    registry.add("multimodal", "pagedllm.features.multimodal:MultiModalExtension")
    registry.add("pooling", "pagedllm.features.pooling:PoolingExtension")
    registry.add("spec", "pagedllm.features.speculative:SpeculativeExtension")
    registry.add("kv_transfer", "pagedllm.features.kv_transfer:KVTransferExtension")


@hookimpl
def pagedllm_register_kv_connectors(registry):
    registry.add("ExampleConnector", "pagedllm.features.kv_shared_storage:SharedStorageConnector")
    registry.add("TCPConnector", "pagedllm.features.kv_tcp:TCPConnector")


@hookimpl
def pagedllm_update_config(config):
    # (An unknown --kv-events-config publisher, or a missing package, is refused before
    # the model loads.)
    events = config.kv_events_config
    if events is not None and events.enable_kv_cache_events:
        from pagedllm.features.kv_events import publisher_class

        publisher_class(events.publisher)
