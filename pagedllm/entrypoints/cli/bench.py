"""``pagedllm bench {latency,throughput,serve}``: vLLM's benchmark harness, same options
and printed figures."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli.common import HELP_TIP, add_config_arg
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager

_KINDS = {
    "latency": "Benchmark the latency of a single batch of requests.",
    "serve": "Benchmark the online serving throughput of a running server.",
    "throughput": "Benchmark offline inference throughput.",
}
PERCENTILES = (10, 25, 50, 75, 90, 99)


def _add_temperature(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Sampling temperature of every request (vLLM's benchmarks sample at 1.0; 0 is "
        "greedy, e.g. to measure speculative decoding on a workload the model copies).",
    )


def _add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="Prompt length in tokens.")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens to generate.")
    parser.add_argument("--batch-size", type=int, default=8, help="Prompts per batch.")
    parser.add_argument("--n", type=int, default=1, help="Sequences per prompt.")
    parser.add_argument(
        "--num-iters-warmup", type=int, default=10, help="Iterations run before measuring."
    )
    parser.add_argument("--num-iters", type=int, default=30, help="Measured iterations.")
    _add_temperature(parser)
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize the outputs (measures the engine alone).",
    )
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")


def _add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default=None,
        help="Prompts: random token ids, or a ShareGPT-style JSON file "
        "(--dataset-path). Default: sharegpt with --dataset-path, else random.",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="A ShareGPT-style JSON file (list of {conversations: [...]}).",
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="Prompt length of the random dataset (default 1024).",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="Output length (default 128; with ShareGPT, the reply's length).",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Random lengths vary uniformly by this fraction around the mean.",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="Random tokens shared by every random prompt, before its own.",
    )
    parser.add_argument("--n", type=int, default=1, help="Sequences per prompt.")
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts.")
    _add_temperature(parser)
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize the outputs (measures the engine alone).",
    )
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")


class BenchSubcommand(CLISubcommand):
    name = "bench"
    help = "Benchmark latency, offline throughput or a running server."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        kinds = parser.add_subparsers(dest="bench_type", required=True, metavar="BENCH")
        for kind, text in _KINDS.items():
            sub = kinds.add_parser(kind, help=text, description=text, epilog=HELP_TIP)
            if kind == "latency":
                _add_latency_args(sub)
            elif kind == "throughput":
                _add_throughput_args(sub)
            else:
                from pagedllm.entrypoints.cli.bench_serve import add_serve_args

                add_serve_args(sub)
            if kind != "serve":
                add_config_arg(sub)
                EngineArgs.add_cli_args(sub, pm)
            pm.hook.pagedllm_add_cli_args(parser=sub, subcommand=f"bench {kind}")
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        if args.bench_type == "serve":
            from pagedllm.entrypoints.cli.bench_serve import run_serve_bench

            return run_serve_bench(args)
        from pagedllm.entrypoints.llm import LLM

        engine_args = EngineArgs.from_cli_args(args)
        defaults = EngineArgs()
        kwargs = {k: v for k, v in vars(engine_args).items() if v != getattr(defaults, k)}
        model = kwargs.pop("model", engine_args.model)
        start = time.perf_counter()
        llm = LLM(model, plugin_manager=pm, **kwargs)
        startup = time.perf_counter() - start
        print(f"Engine start: {startup:.2f} s")
        if args.bench_type == "latency":
            results = run_latency(llm, args)
        else:
            results = run_throughput(llm, args)
        results["engine_start_seconds"] = startup
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(results, indent=2))
        return 0


def _random_prompts(
    vocab_size: int,
    count: int,
    input_len: int,
    range_ratio: float,
    prefix_len: int,
    rng: random.Random,
) -> list[list[int]]:
    # Skip the lowest ids: tokenizers keep special tokens there.
    low, high = min(100, vocab_size // 4), vocab_size - 1
    prefix = [rng.randint(low, high) for _ in range(prefix_len)]
    prompts = []
    for _ in range(count):
        length = input_len
        if range_ratio:
            length = rng.randint(
                max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
            )
        prompts.append(prefix + [rng.randint(low, high) for _ in range(length)])
    return prompts


def run_latency(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from pagedllm.core.sampling import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": p}
        for p in _random_prompts(engine.vocab_size, args.batch_size, args.input_len, 0, 0, rng)
    ]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=not args.disable_detokenize,
    )
    print(f"Latency: batch {args.batch_size}, {args.input_len} in / {args.output_len} out")

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run_once()
    latencies = np.array([run_once() for _ in range(args.num_iters)])
    percentiles = np.percentile(latencies, PERCENTILES)
    print(f"Avg latency: {latencies.mean():.4f} seconds")
    for p, value in zip(PERCENTILES, percentiles, strict=True):
        print(f"{p}% percentile latency: {value:.4f} seconds")
    decode_ms = latencies.mean() / args.output_len * 1000
    print(f"Per output token: {decode_ms:.2f} ms ({1000 / decode_ms:.1f} tokens/s per sequence)")
    return {
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, percentiles, strict=True)},
    }


def _sharegpt_prompts(
    llm: Any, path: str, count: int, output_len: int | None, rng: random.Random
) -> list[tuple[list[int], int]]:
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ConfigError("--dataset-name sharegpt needs a tokenizer")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--dataset-path {path}: cannot read a JSON dataset: {exc}") from exc
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt = tokenizer.encode(turns[0].get("value", ""))
        reply = tokenizer.encode(turns[1].get("value", ""))
        length = output_len or len(reply)
        if len(prompt) < 4 or length < 4 or len(prompt) + length > llm.llm_engine.max_model_len:
            continue
        pairs.append((prompt, length))
    if not pairs:
        raise ConfigError(f"--dataset-path {path}: no usable conversations")
    rng.shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(count)]


def run_throughput(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.core.sampling import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    dataset = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if dataset == "sharegpt":
        if not args.dataset_path:
            raise ConfigError("--dataset-name sharegpt needs --dataset-path")
        pairs = _sharegpt_prompts(llm, args.dataset_path, args.num_prompts, args.output_len, rng)
    else:
        if args.dataset_path:
            raise ConfigError("--dataset-path is only read with --dataset-name sharegpt")
        input_len = args.input_len or 1024
        output_len = args.output_len or 128
        prompts = _random_prompts(
            engine.vocab_size,
            args.num_prompts,
            input_len,
            args.random_range_ratio,
            args.prefix_len,
            rng,
        )
        pairs = [(p, output_len) for p in prompts]
    params = [
        SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=length,
            detokenize=not args.disable_detokenize,
        )
        for _, length in pairs
    ]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in pairs], params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
        f"tokens/s, {output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
