"""``pagedllm bench serve``: load-test any OpenAI-compatible server, like vLLM's
benchmark_serving: streamed requests, Poisson arrivals, optional concurrency cap, and
the same summary (throughput, TTFT, TPOT, ITL, E2EL) and result JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.cli.bench_serve_client import (
    CHAT_ENDPOINT,
    BenchError,
    RequestInput,
    RequestResult,
    ServerInfo,
    make_payload,
    stream_request,
)

METRICS = ("ttft", "tpot", "itl", "e2el")  # as in bench_serve_metrics (which loads numpy)

COMPLETIONS_ENDPOINT = "/v1/completions"
BACKEND_ENDPOINTS = {"vllm": COMPLETIONS_ENDPOINT, "openai": COMPLETIONS_ENDPOINT}
BACKEND_ENDPOINTS["openai-chat"] = CHAT_ENDPOINT


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("Server")
    server.add_argument(
        "--backend",
        choices=sorted(BACKEND_ENDPOINTS),
        default=None,
        help="vLLM's backend names: 'vllm'/'openai' use /v1/completions, 'openai-chat' "
        "/v1/chat/completions. Default: from --endpoint.",
    )
    server.add_argument(
        "--base-url", default=None, help="Server URL (e.g. http://host:8000); overrides --host."
    )
    server.add_argument("--host", default="127.0.0.1", help="Server host (default %(default)s).")
    server.add_argument("--port", type=int, default=8000, help="Server port (default 8000).")
    server.add_argument(
        "--endpoint",
        default=None,
        help="API path: /v1/completions (default) or /v1/chat/completions.",
    )
    server.add_argument(
        "--model", default=None, help="Model name to request; default: the server's first."
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="Local tokenizer for prompt lengths; default: the server's /tokenize.",
    )
    from pagedllm.entrypoints.cli.bench_data import add_dataset_args

    data = add_dataset_args(
        parser,
        ("random", "sharegpt", "prefix_repetition"),
        "Requests sent before the benchmark (from its own, at --max-concurrency), unmeasured "
        "(default 0)",
    )
    data.add_argument("--dataset-path", default=None, help="A ShareGPT-style JSON file.")
    data.add_argument("--num-prompts", type=int, default=1000, help="Requests to send.")
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output length of every ShareGPT request (default: the reply's length).",
    )
    load = parser.add_argument_group("Load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals; inf (default) sends all at once.",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival intervals (1 = Poisson).",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="Most requests in flight at once."
    )
    load.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrivals.")
    load.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos=true.")
    load.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    out = parser.add_argument_group("Results")
    out.add_argument("--save-result", action="store_true", help="Save the results as JSON.")
    out.add_argument("--result-dir", default=None, help="Directory of the JSON file.")
    out.add_argument("--result-filename", default=None, help="Name of the JSON file.")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="Comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el.",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        help="Comma-separated percentiles to report (e.g. 25,50,99).",
    )


def _parse_options(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected if m not in METRICS]
    if unknown:
        raise BenchError(
            f"--percentile-metrics: unknown {', '.join(unknown)} (choose from {', '.join(METRICS)})"
        )
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError as exc:
        raise BenchError(f"--metric-percentiles: {exc}") from exc
    if any(not 0 <= p <= 100 for p in percentiles):
        raise BenchError("--metric-percentiles: each must be in [0, 100]")
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise BenchError("--request-rate and --burstiness must be positive")
    return selected, percentiles


def _resolve_endpoint(args: argparse.Namespace) -> str:
    if args.endpoint is None:
        args.endpoint = BACKEND_ENDPOINTS[args.backend or "vllm"]
    if args.endpoint not in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
        raise BenchError(
            f"--endpoint {args.endpoint}: use {COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT}"
        )
    if args.backend is None:
        args.backend = "openai-chat" if args.endpoint == CHAT_ENDPOINT else "vllm"
    elif BACKEND_ENDPOINTS[args.backend] != args.endpoint:
        raise BenchError(
            f"--backend {args.backend} needs --endpoint {BACKEND_ENDPOINTS[args.backend]}"
        )
    return args.endpoint


def _requests(
    args: argparse.Namespace, server: ServerInfo, model: str, max_model_len: int
) -> list[RequestInput]:
    from pagedllm.entrypoints.cli.bench_data import check_dataset, synthetic_requests
    from pagedllm.entrypoints.cli.bench_serve_data import (
        LocalTokenizer,
        ServerTokenizer,
        sharegpt_requests,
    )

    own = {"sharegpt": ("dataset_path", "sharegpt_output_len")}
    dataset = check_dataset(args, args.num_prompts, own)
    rng = random.Random(args.seed)
    tokenizer = LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(server, model)
    if dataset == "sharegpt":
        return sharegpt_requests(args, tokenizer, max_model_len, rng)
    decode = tokenizer.decode if args.endpoint == CHAT_ENDPOINT else None
    return synthetic_requests(
        args, dataset, args.num_prompts, tokenizer.vocab_size(), rng, decode=decode
    )


async def _arrivals(
    requests: list[RequestInput], rate: float, burstiness: float, rng: random.Random
) -> AsyncIterator[RequestInput]:
    """The requests, spaced by gamma-distributed intervals (Poisson when burstiness=1)."""
    for request in requests:
        yield request
        if rate != float("inf"):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def benchmark(
    args: argparse.Namespace, api_url: str, model: str, requests: list[RequestInput]
) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    from pagedllm.entrypoints.cli.bench_data import warmup_requests

    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def send(request: RequestInput) -> RequestResult:
            payload = make_payload(args.endpoint, model, request, args.ignore_eos)
            return await stream_request(client, api_url, payload, request.prompt_len)

        print("Starting initial single prompt test run...")
        test = await send(requests[0])
        if not test.success:
            raise BenchError(
                "Initial test run failed - Please make sure benchmark arguments are correctly "
                f"specified. Error: {test.error}"
            )
        if args.num_warmups:
            print(f"Warming up with {args.num_warmups} requests...")
            warmup = asyncio.Semaphore(args.max_concurrency or args.num_warmups)

            async def warm(request: RequestInput) -> RequestResult:
                async with warmup:
                    return await send(request)

            await asyncio.gather(*(warm(r) for r in warmup_requests(requests, args.num_warmups)))
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness}")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, file=sys.stderr)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(request: RequestInput) -> RequestResult:
            async with semaphore:
                result = await send(request)
            bar.update()
            return result

        start = time.perf_counter()
        tasks = []
        rng = random.Random(args.seed)
        async for request in _arrivals(requests, args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(limited(request)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(outputs), duration


def run_serve_bench(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return _run(args)
    except BenchError as exc:
        print(f"pagedllm bench serve: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli.bench_serve_metrics import compute_results, summary_lines

    selected, percentiles = _parse_options(args)
    endpoint = _resolve_endpoint(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    server = ServerInfo(base_url)
    try:
        info = server.first_model()
        model = args.model or info["id"]
        max_model_len = int(info.get("max_model_len") or 2048)
        requests = _requests(args, server, model, max_model_len)
    finally:
        server.close()
    print(f"Benchmarking {model} at {base_url}{endpoint} with {len(requests)} prompts")
    outputs, duration = asyncio.run(benchmark(args, base_url + endpoint, model, requests))
    result = compute_results(requests, outputs, duration, selected, percentiles)
    print(
        "\n".join(
            summary_lines(result, selected, percentiles, args.request_rate, args.max_concurrency)
        )
    )
    if args.save_result:
        path = save_result(args, model, result)
        print(f"Results saved to {path}")
    return 0


def save_result(args: argparse.Namespace, model: str, result: dict[str, Any]) -> Path:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    rate = args.request_rate if args.request_rate < float("inf") else "inf"
    record = {
        "date": date,
        "backend": args.backend,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result,
    }
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"{args.backend}-{args.request_rate}qps{concurrency}-{model.rstrip('/').split('/')[-1]}"
        f"-{date}.json"
    )
    directory = Path(args.result_dir) if args.result_dir else Path()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.write_text(json.dumps(record), encoding="utf-8")
    except OSError as exc:
        raise BenchError(f"cannot save the results in {directory / name}: {exc}") from exc
    return path
