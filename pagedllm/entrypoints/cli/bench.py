"""``pagedllm bench {latency,throughput,serve}``: vLLM's benchmark harness, same options
and printed figures."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli.bench_data import (
    add_dataset_args,
    check_dataset,
    dataset_name,
    synthetic_requests,
    warmup_requests,
)
from pagedllm.entrypoints.cli.bench_serve_client import BenchError
from pagedllm.entrypoints.cli.common import HELP_TIP, add_config_arg
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager

# The engine arguments are imported when the parser is built or a benchmark runs
# (``pagedllm --help`` imports this module for the one-line help only).

_KINDS = {
    "latency": "Benchmark the latency of a single batch of requests.",
    "serve": "Benchmark the online serving throughput of a running server.",
    "throughput": "Benchmark offline inference throughput.",
}
PERCENTILES = (10, 25, 50, 75, 90, 99)
# What ``bench latency --help`` says of its figures beyond vLLM's.
_LATENCY_FIGURES = (
    " Besides the request latency it reports, as llama-bench does, prefill throughput "
    "(prompt tokens computed / time to the first token) and decode time per token "
    "(ms per output token after the first), medians over the iterations, from the times "
    "the engine records for each request; both go in --output-json as "
    "prefill_tokens_per_s and decode_ms_per_token."
)


def _add_temperature(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Sampling temperature of every request (vLLM's benchmarks sample at 1.0; 0 is "
        "greedy, e.g. to measure speculative decoding on a workload the model copies).",
    )


def _add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-len", type=int, default=None, help="Prompt length in tokens (default 32)."
    )
    parser.add_argument(
        "--output-len", type=int, default=None, help="Tokens to generate (default 128)."
    )
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
    add_dataset_args(
        parser,
        ("random", "prefix_repetition"),
        "Warm-up iterations (batches), vLLM bench serve's spelling of --num-iters-warmup, "
        "which it overrides",
    )


def _add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="A ShareGPT-style JSON file (list of {conversations: [...]}).",
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="Prompt length of the random dataset (--random-input-len wins; default 1024).",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="Output length (--random-output-len or --prefix-repetition-output-len wins; "
        "default 128; with ShareGPT, the reply's length).",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=None,
        help="Random tokens shared by every random prompt (--random-prefix-len wins).",
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
    add_dataset_args(
        parser,
        ("random", "sharegpt", "prefix_repetition"),
        "Requests run before the measured run (the benchmark's own), unmeasured (default 0)",
    )


class BenchSubcommand(CLISubcommand):
    name = "bench"
    help = "Benchmark latency, offline throughput or a running server."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        from pagedllm.core.engine_args import EngineArgs

        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        kinds = parser.add_subparsers(dest="bench_type", required=True, metavar="BENCH")
        for kind, text in _KINDS.items():
            description = text + (_LATENCY_FIGURES if kind == "latency" else "")
            sub = kinds.add_parser(kind, help=text, description=description, epilog=HELP_TIP)
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
        from pagedllm.core.engine_args import EngineArgs
        from pagedllm.entrypoints.llm import LLM

        _check_dataset(args)
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


# The flags of each command that a dataset reads besides its own (bench_data).
_OWN_FLAGS = {
    "latency": {"random": ("input_len",)},
    "throughput": {"random": ("input_len", "prefix_len"), "sharegpt": ("dataset_path",)},
}


def _check_dataset(args: argparse.Namespace) -> None:
    """The dataset's flags, checked before the engine starts."""
    count = args.batch_size if args.bench_type == "latency" else args.num_prompts
    try:
        check_dataset(args, count, _OWN_FLAGS[args.bench_type])
    except BenchError as exc:
        raise ConfigError(str(exc)) from None


def _sampling(args: argparse.Namespace, max_tokens: int) -> Any:
    """One benchmark request's sampling: exactly ``max_tokens`` tokens (no EOS stop)."""
    from pagedllm.core.sampling import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=max_tokens,
        detokenize=not args.disable_detokenize,
    )


def _synthetic(args: argparse.Namespace, count: int, vocab_size: int, rng: random.Random) -> Any:
    fallbacks = {
        "random_input_len": args.input_len,
        "random_output_len": args.output_len,
        "random_prefix_len": getattr(args, "prefix_len", None),
        "prefix_repetition_output_len": args.output_len,
    }
    try:
        return synthetic_requests(args, dataset_name(args), count, vocab_size, rng, fallbacks)
    except BenchError as exc:
        raise ConfigError(str(exc)) from None


def phase_times(outputs: list[Any]) -> tuple[float, int, int, float | None] | None:
    """One batch's prefill and decode, from the times the engine recorded for each
    request: (seconds from the first arrival to the last request's first token, prompt
    tokens computed in them, prompt tokens the prefix cache supplied, mean seconds per
    output token after the first, None when every request asked for one token). None
    when some request has no recorded times."""
    metrics = [o.metrics for o in outputs]
    if not metrics or any(m is None or m.first_token_time is None for m in metrics):
        return None
    prefill = max(m.first_token_time for m in metrics) - min(m.arrival_time for m in metrics)
    cached = sum(o.num_cached_tokens for o in outputs)
    computed = sum(len(o.prompt_token_ids) for o in outputs) - cached
    per_token = [
        (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1)
        for m in metrics
        if m.num_generation_tokens > 1
    ]
    decode = sum(per_token) / len(per_token) if per_token else None
    return prefill, computed, cached, decode


def run_latency(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    engine = llm.llm_engine
    # (Latency's own defaults, which the random dataset's flags override.)
    args.input_len = 32 if args.input_len is None else args.input_len
    args.output_len = 128 if args.output_len is None else args.output_len
    requests = _synthetic(args, args.batch_size, engine.vocab_size, random.Random(0))
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = [_sampling(args, r.output_len) for r in requests]
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests) * args.n
    print(
        f"Latency: batch {len(requests)}, {prompt_tokens} prompt tokens, "
        f"{output_tokens} output tokens"
    )

    last: list[Any] = []
    phases: list[tuple[float, int, int, float | None] | None] = []

    def run_once() -> float:
        start = time.perf_counter()
        last[:] = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    warmups = args.num_iters_warmup if args.num_warmups is None else args.num_warmups
    for _ in range(warmups):
        run_once()
    measured = []
    for _ in range(args.num_iters):
        measured.append(run_once())
        phases.append(phase_times(last))
    latencies = np.array(measured)
    percentiles = np.percentile(latencies, PERCENTILES)
    print(f"Avg latency: {latencies.mean():.4f} seconds")
    for p, value in zip(PERCENTILES, percentiles, strict=True):
        print(f"{p}% percentile latency: {value:.4f} seconds")
    output_len = output_tokens / (len(requests) * args.n)
    decode_ms = latencies.mean() / output_len * 1000
    print(f"Per output token: {decode_ms:.2f} ms ({1000 / decode_ms:.1f} tokens/s per sequence)")
    results = {
        # (Of one batch, as it ran.)
        "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in last),
        "num_output_tokens": sum(len(c.token_ids) for o in last for c in o.outputs),
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, percentiles, strict=True)},
    }
    results.update(_phase_figures(phases))
    return results


def _phase_figures(phases: list[tuple[float, int, int, float | None] | None]) -> dict[str, Any]:
    """Prefill tokens/s and decode ms/token, medians over the iterations, printed and as
    ``--output-json`` keys (llama-bench's pp and tg figures)."""
    import numpy as np

    known = [p for p in phases if p is not None]
    if not known:
        print("Prefill and decode: not recorded by this engine")
        return {}
    ttft = float(np.median([p[0] for p in known]))
    prefill = float(np.median([p[1] / p[0] for p in known]))
    computed = int(np.median([p[1] for p in known]))
    cached = max(p[2] for p in known)
    print(
        f"Prefill: {prefill:.1f} tokens/s ({computed} prompt tokens computed, median "
        f"time to first token {ttft * 1000:.1f} ms)"
    )
    if cached:
        print(
            f"  ({cached} prompt tokens came from the prefix cache, filled by the same "
            "prompts before: --no-enable-prefix-caching times the whole prefill)"
        )
    figures: dict[str, Any] = {
        "prefill_tokens_per_s": prefill,
        "time_to_first_token_s": ttft,
        "prefill_cached_tokens": cached,
    }
    decodes = [p[3] for p in known if p[3] is not None]
    if decodes:
        decode_ms = float(np.median(decodes)) * 1000
        print(f"Decode: {decode_ms:.2f} ms/token ({1000 / decode_ms:.1f} tokens/s per sequence)")
        figures["decode_ms_per_token"] = decode_ms
    return figures


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
    engine = llm.llm_engine
    rng = random.Random(0 if args.seed is None else args.seed)
    if dataset_name(args) == "sharegpt":
        pairs = _sharegpt_prompts(llm, args.dataset_path, args.num_prompts, args.output_len, rng)
    else:
        requests = _synthetic(args, args.num_prompts, engine.vocab_size, rng)
        pairs = [(r.prompt, r.output_len) for r in requests]
    params = [_sampling(args, length) for _, length in pairs]
    prompts = [{"prompt_token_ids": p} for p, _ in pairs]
    warmup = warmup_requests(list(range(len(pairs))), args.num_warmups)
    if warmup:
        print(f"Warming up with {len(warmup)} requests...")
        llm.generate([prompts[i] for i in warmup], [params[i] for i in warmup], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
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
