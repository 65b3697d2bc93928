"""The contract between pagedllm and its plugins.

A plugin is a module (or object) named by an entry point in the ``pagedllm`` group. It
implements any of the hooks below, marked with :data:`hookimpl`::

    from pagedllm import hookimpl

    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add("mydev", "my_pkg.device:MyDevice")

Registration hooks receive a typed :class:`~pagedllm.core.plugins.Registry` and call
``registry.add(name, target)``; ``target`` is a class or a lazy ``"module:Class"``
string, imported only when that entry is used. Lifecycle hooks are called a few times
per process, never per token or per layer.

Every hook is called through pluggy's hook callers (a registration hook once per
registry), so ``@hookimpl(wrapper=True)`` wrappers, ``tryfirst``/``trylast`` and pluggy's
hook-call monitoring and tracing apply. A plugin that implements a hook not defined
here (a misspelled name) or defines a hook function without ``@hookimpl`` fails to load,
with an error naming the hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from pagedllm.core.plugins import Registry

PROJECT_NAME = "pagedllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegistrationSpecs:
    """Hooks that fill the registries. Each is called once per plugin manager."""

    @hookspec
    def pagedllm_register_devices(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.Device` classes (``--device``)."""

    @hookspec
    def pagedllm_register_load_formats(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.ModelLoader` classes (``--load-format``)."""

    @hookspec
    def pagedllm_register_quantization_methods(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.QuantizationConfig` classes (``-q``)."""

    @hookspec
    def pagedllm_register_models(self, registry: Registry) -> None:
        """Add model classes under their Hugging Face architecture names."""

    @hookspec
    def pagedllm_register_tool_parsers(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.ToolParser` classes."""

    @hookspec
    def pagedllm_register_reasoning_parsers(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.ReasoningParser` classes."""

    @hookspec
    def pagedllm_register_guided_backends(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.GuidedBackend` classes."""

    @hookspec
    def pagedllm_register_attention_backends(self, registry: Registry) -> None:
        """Add attention backends, named for the device or kernel they use."""

    @hookspec
    def pagedllm_register_cli_subcommands(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.CLISubcommand` classes."""

    @hookspec
    def pagedllm_register_stat_loggers(self, registry: Registry) -> None:
        """Add stat loggers that receive engine statistics periodically."""

    @hookspec
    def pagedllm_register_logits_processors(self, registry: Registry) -> None:
        """Add logits processors that requests may name."""

    @hookspec
    def pagedllm_register_executors(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.executor.Executor` classes
        (``--distributed-executor-backend``)."""

    @hookspec
    def pagedllm_register_schedulers(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.scheduler.SchedulerInterface` classes
        (``--scheduler-cls NAME``)."""

    @hookspec
    def pagedllm_register_step_extensions(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.extension.StepExtension` classes (a
        plugin's is turned on by ``--step-extensions NAME``)."""

    @hookspec
    def pagedllm_register_multimodal_processors(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.multimodal.MultiModalProcessor` classes,
        under the Hugging Face architecture names whose prompts they process."""

    @hookspec
    def pagedllm_register_kv_connectors(self, registry: Registry) -> None:
        """Add :class:`~pagedllm.core.interfaces.kv_connector.KVConnector` classes
        (``--kv-transfer-config '{"kv_connector": NAME, ...}'``)."""


class LifecycleSpecs:
    """Hooks called at a few well-defined moments."""

    @hookspec
    def pagedllm_add_cli_args(self, parser: argparse.ArgumentParser, subcommand: str) -> None:
        """Add options to the parser of ``subcommand`` (``serve``, ``run-batch``, ...)."""

    @hookspec
    def pagedllm_update_config(self, config: Any) -> None:
        """Inspect or adjust the engine configuration before the engine is built."""

    @hookspec
    def pagedllm_add_api_routes(self, app: Any, engine: Any) -> None:
        """Add routes or middleware to the OpenAI-compatible FastAPI app."""

    @hookspec
    def pagedllm_engine_started(self, engine: Any) -> None:
        """Called once the engine has loaded its model and is ready."""

    @hookspec
    def pagedllm_request_finished(self, request_output: Any) -> None:
        """Called once per finished request with its final output."""


# Registry kind -> the hook that fills it.
REGISTRATION_HOOKS: dict[str, str] = {
    "devices": "pagedllm_register_devices",
    "load_formats": "pagedllm_register_load_formats",
    "quantization_methods": "pagedllm_register_quantization_methods",
    "models": "pagedllm_register_models",
    "tool_parsers": "pagedllm_register_tool_parsers",
    "reasoning_parsers": "pagedllm_register_reasoning_parsers",
    "guided_backends": "pagedllm_register_guided_backends",
    "attention_backends": "pagedllm_register_attention_backends",
    "cli_subcommands": "pagedllm_register_cli_subcommands",
    "stat_loggers": "pagedllm_register_stat_loggers",
    "logits_processors": "pagedllm_register_logits_processors",
    "executors": "pagedllm_register_executors",
    "schedulers": "pagedllm_register_schedulers",
    "step_extensions": "pagedllm_register_step_extensions",
    "multimodal_processors": "pagedllm_register_multimodal_processors",
    "kv_connectors": "pagedllm_register_kv_connectors",
}
