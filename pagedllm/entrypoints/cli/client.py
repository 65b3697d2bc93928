"""``pagedllm chat`` and ``pagedllm complete``: clients of a running server."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, ClassVar

from pagedllm.core.errors import NotBuiltError
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager


class _ClientSubcommand(CLISubcommand):
    quick_metavar: ClassVar[str]
    quick_help: ClassVar[str]

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        parser.add_argument(
            "--url",
            default="http://localhost:8000/v1",
            help="URL of the running OpenAI-compatible API server (default: %(default)s)",
        )
        parser.add_argument(
            "--model-name",
            default=None,
            help="Model to use; by default the first one the server lists.",
        )
        parser.add_argument(
            "--api-key",
            default=None,
            help="API key; overrides the OPENAI_API_KEY environment variable.",
        )
        parser.add_argument(
            "-q", "--quick", default=None, metavar=self.quick_metavar, help=self.quick_help
        )
        self.add_own_args(parser)
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def add_own_args(self, parser: argparse.ArgumentParser) -> None:
        """Options only this client has."""

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        raise NotBuiltError(f"'pagedllm {self.name}' is not part of this build yet")


class ChatSubcommand(_ClientSubcommand):
    name = "chat"
    help = "Generate chat completions via the running API server."
    quick_metavar = "MESSAGE"
    quick_help = "Send MESSAGE, print the reply and exit."

    def add_own_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--system-prompt",
            default=None,
            help="System prompt added to the chat, for models that support one.",
        )


class CompleteSubcommand(_ClientSubcommand):
    name = "complete"
    help = "Generate text completions for prompts via the running API server."
    quick_metavar = "PROMPT"
    quick_help = "Send PROMPT, print the completion and exit."
