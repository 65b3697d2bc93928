"""``pagedllm bench throughput`` and ``latency`` with vLLM's benchmark command lines: the
random and prefix-repetition datasets' flags (``--random-input-len``, ...,
``--prefix-repetition-*``) and ``--num-warmups``, each changing what runs (``bench serve``
takes the same flags: test_client_cli.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import run_cli
from tiny_models import make_checkpoint

from pagedllm import LLM
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.entrypoints.cli.bench import BenchSubcommand, run_latency, run_throughput

ENGINE = ("--dtype", "float32", "--max-model-len", "64", "--num-gpu-blocks-override", "64")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bench") / "llama", "llama")


def _totals(stdout: str) -> tuple[int, int]:
    lines = dict(line.split(":", 1) for line in stdout.splitlines() if line.startswith("Total num"))
    return int(lines["Total num prompt tokens"]), int(lines["Total num output tokens"])


def test_throughput_runs_vllms_random_dataset_command(checkpoint):
    """vLLM's spelling of the random dataset (was: unrecognized arguments); the prompt
    and output lengths are the flags' (the prefix before every prompt)."""
    result = run_cli(
        "bench", "throughput", "--model", str(checkpoint), "--dataset-name", "random",
        "--random-input-len", "12", "--random-output-len", "3", "--random-prefix-len", "4",
        "--num-prompts", "3", *ENGINE, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert _totals(result.stdout) == (3 * (4 + 12), 3 * 3)


def test_throughput_range_ratio_and_prefix_repetition(checkpoint):
    """--random-range-ratio varies the lengths (ratio 0: exactly 8 x 20); the
    prefix-repetition dataset makes num_prefixes * (num_prompts // num_prefixes)
    prompts of prefix + suffix tokens."""
    ranged = run_cli(
        "bench", "throughput", "--model", str(checkpoint), "--random-input-len", "20",
        "--random-output-len", "4", "--random-range-ratio", "0.5", "--num-prompts", "8",
        *ENGINE, timeout=300,
    )  # fmt: skip
    assert ranged.returncode == 0, ranged.stderr[-3000:]
    prompt_tokens, output_tokens = _totals(ranged.stdout)
    assert prompt_tokens != 8 * 20 and 8 * 10 <= prompt_tokens <= 8 * 30
    assert output_tokens != 8 * 4 and 8 * 2 <= output_tokens <= 8 * 6
    repeated = run_cli(
        "bench", "throughput", "--model", str(checkpoint), "--dataset-name",
        "prefix_repetition", "--prefix-repetition-prefix-len", "8",
        "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "3", "--num-prompts", "5", *ENGINE, timeout=300,
    )  # fmt: skip
    assert repeated.returncode == 0, repeated.stderr[-3000:]
    assert _totals(repeated.stdout) == (4 * (8 + 4), 4 * 3)


def test_latency_takes_the_random_dataset_flags(checkpoint, tmp_path):
    output = tmp_path / "latency.json"
    result = run_cli(
        "bench", "latency", "--model", str(checkpoint), "--random-input-len", "10",
        "--random-output-len", "3", "--random-prefix-len", "2", "--batch-size", "2",
        "--num-iters", "1", "--num-warmups", "0", "--output-json", str(output), *ENGINE,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert (results["num_prompt_tokens"], results["num_output_tokens"]) == (2 * 12, 2 * 3)
    assert len(results["latencies"]) == 1


def test_latency_reports_prefill_and_decode_apart(checkpoint, tmp_path):
    """As llama-bench's pp and tg: prefill tokens/s (prompt tokens / time to the first
    token) and decode ms per output token after the first, from the engine's request
    times, in the text and the JSON beside vLLM's keys; together they fit in the request's
    latency. Without the prefix cache every prompt token is computed."""
    output = tmp_path / "latency.json"
    result = run_cli(
        "bench", "latency", "--model", str(checkpoint), "--input-len", "24", "--output-len",
        "6", "--batch-size", "1", "--num-iters", "1", "--num-iters-warmup", "1",
        "--no-enable-prefix-caching", "--output-json", str(output), *ENGINE, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert {"avg_latency", "latencies", "percentiles"} <= set(results)
    prefill, ttft = results["prefill_tokens_per_s"], results["time_to_first_token_s"]
    decode_ms = results["decode_ms_per_token"]
    assert prefill > 0 and ttft > 0 and decode_ms > 0
    assert results["prefill_cached_tokens"] == 0
    assert results["num_prompt_tokens"] == 24 and prefill * ttft == pytest.approx(24)
    (latency,) = results["latencies"]
    assert ttft + decode_ms / 1000 * (6 - 1) <= latency
    assert f"Prefill: {prefill:.1f} tokens/s (24 prompt tokens computed, " in result.stdout
    assert f"Decode: {decode_ms:.2f} ms/token" in result.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ("throughput", "--dataset-name", "random", "--prefix-repetition-prefix-len", "8"),
            "--prefix-repetition-prefix-len applies to --dataset-name prefix_repetition, "
            "not random",
        ),
        (
            ("latency", "--dataset-name", "prefix_repetition", "--input-len", "8"),
            "--input-len applies to --dataset-name random, not prefix_repetition",
        ),
        (
            ("throughput", "--dataset-path", "x.json", "--random-input-len", "5"),
            "--random-input-len applies to --dataset-name random, not sharegpt",
        ),
        (("throughput", "--random-range-ratio", "1"), "--random-range-ratio 1.0: must be in"),
        (("latency", "--num-warmups", "-1"), "--num-warmups -1: must not be negative"),
        (
            # (vLLM's defaults: --batch-size 8, 10 prefixes)
            ("latency", "--dataset-name", "prefix_repetition"),
            "--prefix-repetition-num-prefixes 10: must be 1 to the number of prompts (8)",
        ),
        (
            ("throughput", "--dataset-name", "prefix_repetition", "--num-prompts", "3"),
            "--prefix-repetition-num-prefixes 10: must be 1 to the number of prompts (3)",
        ),
        (("throughput", "--dataset-name", "sharegpt"), "sharegpt needs --dataset-path"),
    ],
)
def test_a_flag_of_another_dataset_is_refused(checkpoint, arguments, message):
    """Refused by name before the engine starts, not ignored."""
    result = run_cli("bench", *arguments, "--model", str(checkpoint), timeout=120)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr[-2000:]
    assert "Engine start" not in result.stdout


def _args(*arguments: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    BenchSubcommand().add_parser(parser.add_subparsers(dest="subcommand"), make_plugin_manager())
    return parser.parse_args(["bench", *arguments, "--model", "m"])


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_num_warmups_runs_requests_before_the_measured_run(checkpoint, kind):
    """The warm-up requests run first (the measured run then finds their prompts in the
    prefix cache); without them nothing runs before (no hits)."""
    common = ("--random-input-len", "16", "--random-output-len", "2")
    own = {
        "throughput": ("--num-prompts", "2"),
        "latency": ("--batch-size", "2", "--num-iters", "1"),
    }[kind]
    run = {"throughput": run_throughput, "latency": run_latency}[kind]
    stats, figures = [], []
    for warmups in ("0", "2"):
        llm = LLM(str(checkpoint), dtype="float32", enable_prefix_caching=True, block_size=8)
        try:
            figures.append(run(llm, _args(kind, *common, *own, "--num-warmups", warmups)))
            stats.append(llm.llm_engine.kv_manager.total_prefix_cache_stats)
        finally:
            llm.llm_engine.shutdown()
    # (Requests run: 2 measured; 2 warm-up requests, or latency's 2 warm-up batches of 2.)
    assert [s.requests for s in stats] == [2, 4 if kind == "throughput" else 6]
    assert stats[0].hits == 0 and stats[1].hits > 0
    if kind == "latency":  # the prefill figure says which prompt tokens came from the cache:
        # of each 16-token prompt, its first block (the last one holds the token to compute)
        assert [f["prefill_cached_tokens"] for f in figures] == [0, 2 * 8]


@pytest.mark.parametrize("kind", ["throughput", "serve"])
def test_one_dataset_rule_for_every_command(kind):
    """latency/throughput and serve pick and check the dataset by the same rule."""
    from pagedllm.entrypoints.cli.bench_data import check_dataset
    from pagedllm.entrypoints.cli.bench_serve_client import BenchError

    assert check_dataset(_args(kind), 4) == "random"
    assert check_dataset(_args(kind, "--dataset-path", "x.json"), 4) == "sharegpt"
    with pytest.raises(BenchError, match="--dataset-name sharegpt needs --dataset-path"):
        check_dataset(_args(kind, "--dataset-name", "sharegpt"), 4)
    prefixes = ("--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "5")
    assert check_dataset(_args(kind, *prefixes), 5) == "prefix_repetition"
    with pytest.raises(BenchError, match="num-prefixes 5: must be 1 to the number of prompts"):
        check_dataset(_args(kind, *prefixes), 4)
