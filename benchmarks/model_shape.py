"""The model-shape arguments that ``make_llama_gguf.py`` and ``make_checkpoint.py`` share
(widths, layers, heads, vocabulary), and their checks."""

from __future__ import annotations

import argparse


def add_shape_arguments(parser: argparse.ArgumentParser, head_dim: bool = False) -> None:
    """--hidden, --layers, --heads, --kv-heads, (``head_dim``: --head-dim,) --ffn, --vocab."""
    parser.add_argument("--hidden", type=int, required=True, help="Embedding width.")
    parser.add_argument("--layers", type=int, required=True, help="Decoder layers.")
    parser.add_argument("--heads", type=int, required=True, help="Attention heads.")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads).")
    if head_dim:
        parser.add_argument(
            "--head-dim", type=int, default=None, help="Width of a head (default: hidden / heads)."
        )
    parser.add_argument("--ffn", type=int, required=True, help="Feed-forward width.")
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="Vocabulary size, at least the tokenizer's (default: the tokenizer's).",
    )


def check_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kv-heads defaults to --heads; the sizes (and --context) must be positive and the
    query heads a multiple of the KV heads (a parser error otherwise)."""
    args.kv_heads = args.kv_heads or args.heads
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "context"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
