"""``pagedllm bench {latency,serve,throughput}``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedllm.core.errors import NotBuiltError
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager

_KINDS = {
    "latency": "Benchmark the latency of a single batch of requests.",
    "serve": "Benchmark the online serving throughput of a running server.",
    "throughput": "Benchmark offline inference throughput.",
}


class BenchSubcommand(CLISubcommand):
    name = "bench"
    help = "Benchmark latency, offline throughput or a running server."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        kinds = parser.add_subparsers(dest="bench_type", required=True, metavar="BENCH")
        for kind, text in _KINDS.items():
            sub = kinds.add_parser(kind, help=text, description=text)
            pm.hook.pagedllm_add_cli_args(parser=sub, subcommand=f"bench {kind}")
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        raise NotBuiltError(f"'pagedllm bench {args.bench_type}' is not part of this build yet")
