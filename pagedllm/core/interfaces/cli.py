"""The CLI-subcommand extension point: ``pagedllm NAME ...``."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager


class CLISubcommand(ABC):
    """One ``pagedllm`` subcommand, registered under its ``name``.

    Contract: :meth:`add_parser` adds this command's parser to ``subparsers`` (calling the
    ``pagedllm_add_cli_args`` hook so plugins can add options) and returns it; :meth:`run`
    executes the parsed command and returns the process exit code. A
    :class:`~pagedllm.core.errors.PagedLLMError` raised by :meth:`run` is printed as
    ``pagedllm NAME: error: ...`` with exit code 2.
    """

    name: ClassVar[str]
    help: ClassVar[str]

    @abstractmethod
    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        """Add and return this subcommand's parser."""

    @abstractmethod
    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        """Run the command; the return value is the exit code."""
