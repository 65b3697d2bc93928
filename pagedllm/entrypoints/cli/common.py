"""Pieces shared by the subcommands that start an engine."""

from __future__ import annotations

import argparse

HELP_TIP = """\
Use --help=KEYWORD to explore the options:
  --help=ModelConfig   one argument group
  --help=max-num-seqs  one argument
  --help=max           every argument mentioning a keyword
  --help=listgroup     the list of groups"""


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="CONFIG",
        help="Read options from a YAML file whose keys are option names "
        "(e.g. 'max-num-seqs: 8'); options given on the command line win.",
    )
