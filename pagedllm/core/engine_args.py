"""Engine arguments: every option that configures the engine, shared by the CLI and ``LLM``.

Each field is one ``--flag`` declared with :func:`~pagedllm.core.argspec.arg`; its group
names the config object it feeds and is what ``--help=GROUP`` shows, and its default is
that config's (``ModelConfig.dtype``; see :mod:`pagedllm.core.configs`), or ``None``
where pagedllm picks the value when the flag is unset. The flags, defaults
and choices follow the vLLM server-usage chapter, so a vLLM command line works unchanged.

The fields are declared by concern in :mod:`pagedllm.core.args`: the model and its
weights (:class:`~pagedllm.core.args.model.ModelArgs`), how it runs
(:class:`~pagedllm.core.args.runtime.RuntimeArgs`), scheduling and observability
(:class:`~pagedllm.core.args.scheduling.SchedulingArgs`), and the flags from older vLLM
versions (:class:`~pagedllm.core.args.refusals.DeprecatedArgs`, with every refused
flag's reason). Features pagedllm does not have are accepted, then refused at start-up
when set.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from pagedllm.core.args.model import ModelArgs
from pagedllm.core.args.refusals import DeprecatedArgs
from pagedllm.core.args.runtime import RuntimeArgs
from pagedllm.core.args.scheduling import SchedulingArgs
from pagedllm.core.argspec import add_dataclass_args, dataclass_kwargs

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig, UsageContext
    from pagedllm.core.plugins import PluginManager


# A dataclass takes its fields from the bases in reverse order: the model's options come
# first in --help, the deprecated ones last.
@dataclasses.dataclass
class EngineArgs(DeprecatedArgs, SchedulingArgs, RuntimeArgs, ModelArgs):
    """Arguments for the pagedllm engine (one field per command-line option)."""

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, pm: PluginManager
    ) -> argparse.ArgumentParser:
        """Add one option per engine argument; registry choices come from ``pm``."""
        add_dataclass_args(parser, cls, pm.choices)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**dataclass_kwargs(cls, args))

    def create_engine_config(
        self, pm: PluginManager, usage_context: UsageContext | None = None
    ) -> PagedLLMConfig:
        """Validate these arguments and build the engine's typed configuration."""
        from pagedllm.core.config import UsageContext, create_engine_config

        return create_engine_config(self, pm, usage_context or UsageContext.ENGINE_CONTEXT)
