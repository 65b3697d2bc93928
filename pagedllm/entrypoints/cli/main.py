"""The ``pagedllm`` command."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from pagedllm import __version__
from pagedllm.core.argparser import FlexibleArgumentParser
from pagedllm.core.errors import PagedLLMError
from pagedllm.core.interfaces import CLISubcommand
from pagedllm.core.plugins import PluginManager, make_plugin_manager

# The order of the vLLM command line; subcommands added by plugins follow.
_BUILTIN_ORDER = ["chat", "complete", "serve", "bench", "collect-env", "run-batch", "plugins"]


def build_parser(
    pm: PluginManager, only: str | None = None, *, listing: bool = False
) -> tuple[FlexibleArgumentParser, dict[str, CLISubcommand]]:
    """The ``pagedllm`` parser with every subcommand, or with ``only`` that one (which must
    be registered): a run of one subcommand need not import and build the others.

    ``listing``: each subcommand gets an empty parser carrying its name and one-line
    ``help`` only, enough for ``pagedllm --help``, ``--version`` and the error for a name
    that is not a subcommand (none of which parses a subcommand's options), without
    building every subcommand's options (the engine arguments, the plugins' flags)."""
    parser = FlexibleArgumentParser(
        prog="pagedllm",
        description="pagedllm: LLM inference and serving with a paged KV cache and plugins.",
        epilog="Run 'pagedllm SUBCOMMAND --help' for the options of one subcommand.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    registry = pm.registry("cli_subcommands")
    names = sorted(
        registry.names(),
        key=lambda n: (_BUILTIN_ORDER.index(n) if n in _BUILTIN_ORDER else len(_BUILTIN_ORDER), n),
    )
    if only is not None:
        names = [only]
    else:
        # A name two plugins claim is refused when run (naming both), not in the listing
        # of all the others.
        names = [name for name in names if not registry.entry(name).conflicts]
    commands: dict[str, CLISubcommand] = {}
    for name in names:
        command = registry.load(name)()
        if listing:
            subparsers.add_parser(name, help=command.help)
        else:
            command.add_parser(subparsers, pm)
        commands[name] = command
    return parser, commands


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    try:
        pm = make_plugin_manager()
        args_list = list(sys.argv[1:] if argv is None else argv)
        # ``pagedllm SUBCOMMAND ...`` builds that subcommand's parser alone; anything else
        # (top-level options first, a mistyped name) gets the listing of them all, which
        # never parses a subcommand's options.
        first = args_list[0] if args_list else None
        only = first if first in pm.registry("cli_subcommands").names() else None
        parser, commands = build_parser(pm, only, listing=only is None)
    except PagedLLMError as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(args_list)
    try:
        return commands[args.subcommand].run(args, pm)
    except PagedLLMError as exc:
        print(f"pagedllm {args.subcommand}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
