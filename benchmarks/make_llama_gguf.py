"""Write a Llama-shaped GGUF file with random weights, for timing engines at real model
sizes without downloading one (the same file for every engine):

    python benchmarks/make_llama_gguf.py llama-1b-q4_0.gguf --hidden 2048 --layers 16 \\
        --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --type q4_0

The shape of Llama-3.2-1B above; 3B is ``--hidden 3072 --layers 28 --heads 24 --ffn 8192``.
The tokenizer (``tokenizer.*`` metadata) is copied from another GGUF file, by default the
default model's (SmolLM2, 49152 tokens), and padded with unused ``[PADn]`` tokens up to
``--vocab`` as llama.cpp's converter pads a vocabulary. Every 2-D weight is stored as
``--type`` (norms stay float32, as llama.cpp keeps them); the embedding is tied to the
output unless ``--untied`` (as Llama-3.2-1B/3B; Llama-3.1-8B is untied). The weights are
random (normal, std ``--std``), so Q and K need none of llama.cpp's row permutation and
the text generated is noise: the file is for speed, not quality.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shape import add_shape_arguments, check_shape

# The types gguf.quants can write, as --type spells them.
TYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
    "q8_0": GGMLQuantizationType.Q8_0,
}
# general.file_type, llama.cpp's name for the file's main type.
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="The GGUF file to write.")
    add_shape_arguments(parser)
    parser.add_argument("--type", choices=sorted(TYPES), default="q4_0", help="2-D weights' type.")
    parser.add_argument("--context", type=int, default=4096, help="context_length (tokens).")
    parser.add_argument("--rope-theta", type=float, default=500000.0, help="RoPE base.")
    parser.add_argument("--untied", action="store_true", help="Write an output.weight of its own.")
    parser.add_argument("--std", type=float, default=0.02, help="Std of the random weights.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="GGUF file whose tokenizer.* metadata is copied (default: the default model).",
    )
    args = parser.parse_args(argv)
    check_shape(parser, args)
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        parser.error(f"--hidden {args.hidden} must be an even multiple of --heads {args.heads}")
    block = gguf.GGML_QUANT_SIZES[TYPES[args.type]][0]
    for name in ("hidden", "ffn"):  # the rows' lengths (the products' input widths)
        if getattr(args, name) % block:
            parser.error(
                f"--{name} {getattr(args, name)}: --type {args.type} stores rows in blocks of "
                f"{block} values, so it must be a multiple of {block}"
            )
    return args


def tokenizer_fields(path: Path) -> dict[str, tuple[Any, list[GGUFValueType]]]:
    """``tokenizer.*`` key -> (value, GGUF types) of a GGUF file."""
    reader = gguf.GGUFReader(str(path))
    return {
        key: (field.contents(), field.types)
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    }


def padded_vocabulary(fields: dict[str, tuple[Any, list[GGUFValueType]]], vocab: int) -> None:
    """Pad the token list (and its types and scores) to ``vocab`` entries, in place."""
    tokens = fields["tokenizer.ggml.tokens"][0]
    extra = vocab - len(tokens)
    if extra <= 0:
        return
    fields["tokenizer.ggml.tokens"] = (
        [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), vocab))],
        fields["tokenizer.ggml.tokens"][1],
    )
    if "tokenizer.ggml.token_type" in fields:
        types, kinds = fields["tokenizer.ggml.token_type"]
        fields["tokenizer.ggml.token_type"] = ([*types, *[gguf.TokenType.UNUSED] * extra], kinds)
    if "tokenizer.ggml.scores" in fields:
        scores, kinds = fields["tokenizer.ggml.scores"]
        fields["tokenizer.ggml.scores"] = ([*scores, *[-1000.0] * extra], kinds)


def tensor_shapes(args: argparse.Namespace, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows, row length), in the file's order."""
    head_dim = args.hidden // args.heads
    kv = args.kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, args.hidden)}
    for i in range(args.layers):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (args.hidden,),
                f"blk.{i}.attn_q.weight": (args.hidden, args.hidden),
                f"blk.{i}.attn_k.weight": (kv, args.hidden),
                f"blk.{i}.attn_v.weight": (kv, args.hidden),
                f"blk.{i}.attn_output.weight": (args.hidden, args.hidden),
                f"blk.{i}.ffn_norm.weight": (args.hidden,),
                f"blk.{i}.ffn_gate.weight": (args.ffn, args.hidden),
                f"blk.{i}.ffn_up.weight": (args.ffn, args.hidden),
                f"blk.{i}.ffn_down.weight": (args.hidden, args.ffn),
            }
        )
    shapes["output_norm.weight"] = (args.hidden,)
    if args.untied:
        shapes["output.weight"] = (vocab, args.hidden)
    return shapes


def stored(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` (float32) as the file holds it."""
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = args.tokenizer_from
    if source is None:
        from pagedllm.core.default_model import default_model_path

        source = default_model_path()
    fields = tokenizer_fields(source)
    if "tokenizer.ggml.tokens" not in fields:
        sys.exit(f"--tokenizer-from {source}: the file has no tokenizer.ggml.tokens")
    own = len(fields["tokenizer.ggml.tokens"][0])
    vocab = own if args.vocab is None else args.vocab
    if vocab < own:
        sys.exit(f"--vocab {vocab}: the tokenizer of {source.name} has {own} tokens; give >= {own}")
    padded_vocabulary(fields, vocab)

    qtype = TYPES[args.type]
    writer = gguf.GGUFWriter(str(args.output), "llama")
    writer.add_name(f"random-llama-h{args.hidden}-l{args.layers}-{args.type}")
    writer.add_file_type(FILE_TYPES[args.type])
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(args.hidden // args.heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, types) in fields.items():
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)

    # Tensor infos first, then each tensor made and written in turn: a file of several GB
    # never sits in memory whole.
    shapes = tensor_shapes(args, vocab)
    kinds = {
        name: qtype if len(shape) == 2 else GGMLQuantizationType.F32
        for name, shape in shapes.items()
    }
    for name, shape in shapes.items():
        kind = kinds[name]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if kind == GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(
                name, shape, np.dtype(dtype), int(np.prod(shape)) * dtype().itemsize
            )
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), kind
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, shape in shapes.items():
        if len(shape) == 1:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(args.std)
        writer.write_tensor_data(stored(data, kinds[name]))
    writer.close()
    size = args.output.stat().st_size
    print(f"{args.output}: {len(shapes)} tensors, {vocab} tokens, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
