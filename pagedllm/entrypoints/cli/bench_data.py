"""The synthetic prompts of ``pagedllm bench latency``, ``throughput`` and ``serve``, with
vLLM's flags, spellings and defaults for them:

- ``random``: random token ids, ``--random-input-len`` long (varied uniformly by
  ``--random-range-ratio``, the output lengths too), after ``--random-prefix-len`` random
  tokens shared by every prompt;
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes, each shared
  by ``num_prompts // num_prefixes`` prompts with random suffixes, in random order.

``--num-warmups`` is added here too. A flag of a dataset other than the one chosen is
refused by name, not ignored. ShareGPT files are read by each command (its prompts are
text).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import TypeVar

from pagedllm.entrypoints.cli.bench_serve_client import BenchError, RequestInput

RANDOM_FLAGS = ("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len")
PREFIX_REPETITION_FLAGS = (
    "prefix_repetition_prefix_len",
    "prefix_repetition_suffix_len",
    "prefix_repetition_num_prefixes",
    "prefix_repetition_output_len",
)
T = TypeVar("T")

# vLLM's defaults (its RandomDataset and PrefixRepetitionRandomDataset).
DEFAULTS = {
    "random_input_len": 1024,
    "random_output_len": 128,
    "random_range_ratio": 0.0,
    "random_prefix_len": 0,
    "prefix_repetition_prefix_len": 256,
    "prefix_repetition_suffix_len": 256,
    "prefix_repetition_num_prefixes": 10,
    "prefix_repetition_output_len": 128,
}


def add_dataset_args(
    parser: argparse.ArgumentParser, datasets: tuple[str, ...], warmups: str
) -> argparse._ArgumentGroup:
    """``--dataset-name`` (one of ``datasets``), the random and prefix-repetition
    datasets' flags, and ``--num-warmups`` (``warmups``: what it counts, in its help)."""
    group = parser.add_argument_group("Dataset")
    group.add_argument(
        "--dataset-name",
        choices=datasets,
        default=None,
        help="Default: sharegpt with --dataset-path, else random."
        if "sharegpt" in datasets
        else "Default: random.",
    )

    def add(flag: str, kind: type, text: str) -> None:
        dest = flag.removeprefix("--").replace("-", "_")
        text = f"{text} (default {DEFAULTS[dest]})."
        group.add_argument(flag, type=kind, default=None, help=text)

    add("--random-input-len", int, "Prompt length of the random dataset")
    add("--random-output-len", int, "Output length of the random dataset")
    add(
        "--random-range-ratio",
        float,
        "Random prompt and output lengths are uniform in [len*(1-r), len*(1+r)]",
    )
    add("--random-prefix-len", int, "Random tokens shared by every random prompt, before it")
    add("--prefix-repetition-prefix-len", int, "Tokens of each shared prefix")
    add("--prefix-repetition-suffix-len", int, "Random tokens after the prefix")
    add("--prefix-repetition-num-prefixes", int, "Distinct prefixes")
    add("--prefix-repetition-output-len", int, "Output length of each prompt")
    group.add_argument("--num-warmups", type=int, default=None, help=f"{warmups}.")
    return group


def check_dataset_flags(
    args: argparse.Namespace, dataset: str, others: dict[str, tuple[str, ...]] | None = None
) -> None:
    """Refuse, by name, a flag given for a dataset other than ``dataset`` (``others``: a
    command's own flags, by the datasets that read them), and values out of range."""
    owners = {"random": RANDOM_FLAGS, "prefix_repetition": PREFIX_REPETITION_FLAGS}
    for name, flags in (others or {}).items():
        owners[name] = owners.get(name, ()) + flags
    for owner, flags in owners.items():
        if owner == dataset:
            continue
        for dest in flags:
            if dest in owners.get(dataset, ()):
                continue
            if getattr(args, dest, None) is not None:
                flag = "--" + dest.replace("_", "-")
                raise BenchError(f"{flag} applies to --dataset-name {owner}, not {dataset}")
    ratio = args.random_range_ratio
    if ratio is not None and not 0 <= ratio < 1:
        raise BenchError(f"--random-range-ratio {ratio}: must be in [0, 1)")
    for dest in (*RANDOM_FLAGS, *PREFIX_REPETITION_FLAGS):
        value = getattr(args, dest)
        if dest != "random_range_ratio" and value is not None and value < 0:
            raise BenchError(f"--{dest.replace('_', '-')} {value}: must not be negative")
    if args.num_warmups is not None and args.num_warmups < 0:
        raise BenchError(f"--num-warmups {args.num_warmups}: must not be negative")


def dataset_name(args: argparse.Namespace) -> str:
    """vLLM's rule: ``--dataset-name``, else sharegpt where ``--dataset-path`` is given,
    else random."""
    if args.dataset_name:
        return args.dataset_name
    return "sharegpt" if getattr(args, "dataset_path", None) else "random"


def check_dataset(
    args: argparse.Namespace, count: int, others: dict[str, tuple[str, ...]] | None = None
) -> str:
    """The dataset the flags pick, its flags checked (:func:`check_dataset_flags`) for
    ``count`` prompts, before any engine or server is used."""
    dataset = dataset_name(args)
    check_dataset_flags(args, dataset, others)
    if dataset == "sharegpt" and not args.dataset_path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path")
    if dataset == "prefix_repetition":
        _check_prefixes(args, count)
    return dataset


def _check_prefixes(args: argparse.Namespace, count: int) -> int:
    prefixes = int(setting(args, "prefix_repetition_num_prefixes"))
    if prefixes < 1 or count < prefixes:
        raise BenchError(
            f"--prefix-repetition-num-prefixes {prefixes}: must be 1 to the number of "
            f"prompts ({count})"
        )
    return prefixes


def setting(args: argparse.Namespace, dest: str, fallback: float | None = None) -> float:
    """The flag's value, else ``fallback`` (a command's own spelling, e.g. --input-len),
    else vLLM's default."""
    value = getattr(args, dest)
    if value is None:
        value = fallback
    return DEFAULTS[dest] if value is None else value


def random_prompts(
    vocab_size: int,
    count: int,
    input_len: int,
    range_ratio: float,
    prefix_len: int,
    rng: random.Random,
) -> list[list[int]]:
    # Skip the lowest ids: tokenizers keep special tokens there.
    low, high = min(100, vocab_size // 4), vocab_size - 1
    prefix = _tokens(prefix_len, low, high, rng)
    return [
        prefix + _tokens(length(input_len, range_ratio, rng), low, high, rng) for _ in range(count)
    ]


def length(mean: int, ratio: float, rng: random.Random) -> int:
    """A length uniform in [mean*(1-ratio), mean*(1+ratio)] (at least 1)."""
    if not ratio:
        return mean
    return rng.randint(max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio))))


def _tokens(count: int, low: int, high: int, rng: random.Random) -> list[int]:
    return [rng.randint(low, high) for _ in range(count)]


def synthetic_requests(
    args: argparse.Namespace,
    dataset: str,
    count: int,
    vocab_size: int,
    rng: random.Random,
    fallbacks: dict[str, int | None] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[RequestInput]:
    """``count`` requests of the ``random`` or ``prefix_repetition`` dataset (vLLM makes
    ``num_prefixes * (count // num_prefixes)`` of the latter). ``fallbacks``: a command's
    own flags for the settings (``random_input_len``: its --input-len, ...); ``decode``:
    turns token ids into the prompt text (for a chat endpoint)."""
    fallbacks = fallbacks or {}
    prompts: list[list[int]]
    if dataset == "random":
        ratio = float(setting(args, "random_range_ratio"))
        output_len = int(setting(args, "random_output_len", fallbacks.get("random_output_len")))
        prompts = random_prompts(
            vocab_size,
            count,
            int(setting(args, "random_input_len", fallbacks.get("random_input_len"))),
            ratio,
            int(setting(args, "random_prefix_len", fallbacks.get("random_prefix_len"))),
            rng,
        )
        outputs = [length(output_len, ratio, rng) for _ in prompts]
    elif dataset == "prefix_repetition":
        prompts = _prefix_repetition(args, count, vocab_size, rng)
        fallback = fallbacks.get("prefix_repetition_output_len")
        output_len = int(setting(args, "prefix_repetition_output_len", fallback))
        outputs = [output_len] * len(prompts)
    else:
        raise BenchError(f"--dataset-name {dataset}: not a synthetic dataset")
    return [
        RequestInput(decode(ids) if decode else ids, len(ids), out)
        for ids, out in zip(prompts, outputs, strict=True)
    ]


def _prefix_repetition(
    args: argparse.Namespace, count: int, vocab_size: int, rng: random.Random
) -> list[list[int]]:
    prefixes = _check_prefixes(args, count)
    prefix_len = int(setting(args, "prefix_repetition_prefix_len"))
    suffix_len = int(setting(args, "prefix_repetition_suffix_len"))
    low, high = min(100, vocab_size // 4), vocab_size - 1
    prompts = []
    for _ in range(prefixes):
        prefix = _tokens(prefix_len, low, high, rng)
        prompts += [prefix + _tokens(suffix_len, low, high, rng) for _ in range(count // prefixes)]
    rng.shuffle(prompts)
    return prompts


def warmup_requests(requests: list[T], count: int | None) -> list[T]:
    """``count`` (--num-warmups) warm-up requests: the benchmark's own, from the first,
    cycled."""
    return [requests[i % len(requests)] for i in range(count or 0)] if requests else []
