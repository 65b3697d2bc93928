"""``pagedllm run-batch``: run an OpenAI batch file through the engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedllm.core.argspec import add_dataclass_args, dataclass_kwargs
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError, NotBuiltError
from pagedllm.entrypoints.cli.common import HELP_TIP, add_config_arg
from pagedllm.entrypoints.cli.run_batch_args import RunBatchArgs
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager


class RunBatchSubcommand(CLISubcommand):
    name = "run-batch"
    help = "Run batch prompts and write results to file."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name, help=self.help, description=self.help, epilog=HELP_TIP
        )
        add_config_arg(parser)
        add_dataclass_args(parser, RunBatchArgs, pm.choices)
        EngineArgs.add_cli_args(parser, pm)
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        batch_args = RunBatchArgs(**dataclass_kwargs(RunBatchArgs, args))
        for option, value in (
            ("-i/--input-file", batch_args.input_file),
            ("-o/--output-file", batch_args.output_file),
        ):
            if not value:
                raise ConfigError(f"{option} is required")
        EngineArgs.from_cli_args(args).create_engine_config(pm)
        raise NotBuiltError("run-batch is not part of this pagedllm build yet")
