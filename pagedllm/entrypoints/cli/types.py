"""Kept for plugins written against its old home: ``CLISubcommand`` is an extension-point
ABC like the others, in :mod:`pagedllm.core.interfaces`."""

from pagedllm.core.interfaces.cli import CLISubcommand

__all__ = ["CLISubcommand"]
