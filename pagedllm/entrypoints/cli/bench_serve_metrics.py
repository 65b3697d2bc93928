"""The figures of ``pagedllm bench serve``, computed and printed as vLLM's
benchmark_serving does."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.entrypoints.cli.bench_serve_client import RequestInput, RequestResult

# attribute -> (name in the summary, section header)
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
WIDTH = 50


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_results(
    requests: list[RequestInput],
    outputs: list[RequestResult],
    duration: float,
    selected: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    """vLLM's result dictionary (without the run's metadata)."""
    output_lens, samples = [], {name: [] for name in METRICS}
    total_input = completed = 0
    for request, output in zip(requests, outputs, strict=True):
        if not output.success:
            output_lens.append(0)
            continue
        output_len = output.output_tokens or 0
        output_lens.append(output_len)
        total_input += output.prompt_len or request.prompt_len
        if output_len > 1:
            samples["tpot"].append((output.latency - output.ttft) / (output_len - 1))
        samples["itl"].extend(output.itl)
        samples["ttft"].append(output.ttft)
        samples["e2el"].append(output.latency)
        completed += 1
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for name in selected:
        values = np.array(samples[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(values.mean())
        result[f"median_{name}_ms"] = float(np.median(values))
        result[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return result


def summary_lines(
    result: dict[str, Any],
    selected: list[str],
    percentiles: list[float],
    request_rate: float,
    max_concurrency: int | None,
) -> list[str]:
    lines = [
        f"{' Serving Benchmark Result ':=^{WIDTH}}",
        _row("Successful requests:", result["completed"]),
    ]
    if result["failed"]:
        lines.append(_row("Failed requests:", result["failed"]))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _row("Benchmark duration (s):", float(result["duration"])),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", float(result["request_throughput"])),
        _row("Output token throughput (tok/s):", float(result["output_throughput"])),
        _row("Total Token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    for name in METRICS:
        if name not in selected:
            continue
        label, header = METRICS[name]
        lines.append(f"{header:-^{WIDTH}}")
        lines.append(_row(f"Mean {label} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {label} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            word = percentile_word(p)
            lines.append(_row(f"P{word} {label} (ms):", result[f"p{word}_{name}_ms"]))
    lines.append("=" * WIDTH)
    return lines
