"""A subcommand: ``pagedllm dummy-hello [--who NAME]``."""

from __future__ import annotations

from pagedllm.core.interfaces import CLISubcommand


# [docs:cli]
class HelloSubcommand(CLISubcommand):
    name = "dummy-hello"
    help = "Say hello (a subcommand added by a plugin)."

    def add_parser(self, subparsers, pm):
        parser = subparsers.add_parser(self.name, help=self.help)
        parser.add_argument("--who", default="world")
        # Let plugins add options to this subcommand too, as the built-in ones do.
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args, pm):
        print(f"hello, {args.who}")
        return 0  # the process exit code


# [/docs:cli]
