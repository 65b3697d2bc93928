"""Write a Hugging Face checkpoint directory (config, safetensors, tokenizer) of random
weights in a real model's shape, for the same-checkpoint comparison at sizes and
architectures that no installed package holds (the same directory for every engine):

    python benchmarks/make_checkpoint.py qwen3-0.6b-shape --arch qwen3 --hidden 1024 \\
        --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --ffn 3072 --dtype bfloat16 \\
        --tokenizer-from DIR

The shape of Qwen3-0.6B above, with the vocabulary of the tokenizer copied from DIR (a
checkpoint directory with a ``tokenizer.json``; ``--vocab`` pads the embedding past it).
``--arch`` is a transformers ``model_type`` (llama, mistral, qwen2, qwen3, phi3, gemma3_text,
...): transformers builds the model from its config with its own initialisation, so the
text generated is noise: the checkpoint is for speed, not quality. The embedding is tied
to the output unless ``--untied``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shape import add_shape_arguments, check_shape

# The tokenizer's files a checkpoint directory may hold, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="The directory to write.")
    parser.add_argument("--arch", required=True, help="transformers model_type, e.g. qwen3.")
    add_shape_arguments(parser, head_dim=True)
    parser.add_argument("--context", type=int, default=8192, help="max_position_embeddings.")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--untied", action="store_true", help="An output head of its own.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        required=True,
        help="Checkpoint directory whose tokenizer files are copied (tokenizer.json, ...).",
    )
    args = parser.parse_args(argv)
    check_shape(parser, args)
    if args.head_dim is None:
        if args.hidden % args.heads:
            parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
        args.head_dim = args.hidden // args.heads
    if not (args.tokenizer_from / "tokenizer.json").is_file():
        parser.error(f"--tokenizer-from {args.tokenizer_from}: no tokenizer.json there")
    return args


def tokenizer_size(directory: Path) -> tuple[int, dict[str, int | None]]:
    """The tokenizer's vocabulary size (added tokens included) and its BOS/EOS/PAD ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    ids: dict[str, int | None] = {}
    for role in ("bos", "eos", "pad"):
        token = config.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        ids[role] = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return tokenizer.get_vocab_size(with_added_tokens=True), ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size, ids = tokenizer_size(args.tokenizer_from)
    vocab = args.vocab or size
    if vocab < size:
        print(f"--vocab {vocab} is below the tokenizer's {size} tokens", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        args.arch,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.ffn,
        vocab_size=vocab,
        max_position_embeddings=args.context,
        tie_word_embeddings=not args.untied,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.output, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_from / name).is_file():
            shutil.copy(args.tokenizer_from / name, args.output / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.output}: {args.arch}, {params / 1e6:.0f}M parameters in {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
