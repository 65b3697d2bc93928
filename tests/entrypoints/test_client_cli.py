"""``pagedllm chat``, ``complete``, ``bench serve`` and ``run-batch``, run as a user runs
them (a subprocess per call) against one real server started for this module."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import clean_env, run_cli
from tiny_models import make_checkpoint

API_KEY = "test-key"
ENGINE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "128", "--disable-log-stats")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user_env(**extra: str) -> dict[str, str]:
    env = clean_env(**extra)
    if "OPENAI_API_KEY" not in extra:
        env.pop("OPENAI_API_KEY", None)
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("client_llama"), "llama")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``pagedllm serve`` with an API key; yields its base URL (no ``/v1``)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("client_server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli.main",
        "serve",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        *ENGINE_ARGS,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=user_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited:\n{log_path.read_text(errors='replace')}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_with_stdin(*args: str, stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Like ``run_cli`` with ``stdin`` fed to the command."""
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


# ------------------------------------------------------------------ chat / complete


def test_chat_quick(server: str) -> None:
    result = run_cli(
        "chat", "--url", server + "/v1", "--api-key", API_KEY, "--max-tokens", "8", "-q", "hi",
        env=user_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Using model: " in result.stderr
    assert result.stdout.endswith("\n") and "Traceback" not in result.stderr


def test_complete_quick_with_env_key_and_model_name(server: str, checkpoint: Path) -> None:
    result = run_cli(
        "complete", "--url", server + "/v1", "--model-name", str(checkpoint), "-q", "Once upon",
        env=user_env(OPENAI_API_KEY=API_KEY),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"Using model: {checkpoint}" in result.stderr
    assert result.stdout.endswith("\n")


def test_interactive_chat_reads_lines_until_eof(server: str) -> None:
    result = run_with_stdin(
        "chat", "--url", server + "/v1", "--api-key", API_KEY, "--system-prompt", "Be brief.",
        "--max-tokens", "6",
        stdin="hello there\nand again\n",
        env=user_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") >= 3  # a prompt per line, and one that meets EOF
    assert "error" not in result.stderr.lower()


def test_client_errors_are_one_line_exit_1(server: str) -> None:
    closed = f"http://127.0.0.1:{free_port()}/v1"
    for command in ("chat", "complete"):
        result = run_cli(command, "--url", closed, "-q", "hi", env=user_env())
        assert result.returncode == 1, result.stderr
        assert "cannot connect to the API server" in result.stderr
        assert "Traceback" not in result.stderr
    # The server wants a key and none is given: the placeholder is refused (401).
    result = run_cli("chat", "--url", server + "/v1", "-q", "hi", env=user_env())
    assert result.returncode == 1 and "401" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli(
        "chat", "--url", server + "/v1", "--api-key", API_KEY, "--model-name", "nope", "-q", "hi",
        env=user_env(),
    )  # fmt: skip
    assert result.returncode == 1 and "404" in result.stderr and "nope" in result.stderr


class _FakeStream:
    def __init__(self, pieces: list[str]) -> None:
        self.chunks = [
            SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=p))])
            for p in pieces
        ]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.chunks)


def test_chat_keeps_the_conversation(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli.client import ChatSubcommand

    sent: list[list[dict[str, str]]] = []

    def create(**kwargs: Any) -> _FakeStream:
        sent.append([dict(m) for m in kwargs["messages"]])
        return _FakeStream(["re", "ply"])

    fake = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    command = ChatSubcommand()
    command.conversation = [{"role": "system", "content": "sys"}]
    args = argparse.Namespace(max_tokens=None)
    command.send(fake, "m", args, "one")
    command.send(fake, "m", args, "two")
    assert sent[1] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "two"},
    ]
    assert capsys.readouterr().out == "reply\nreply\n"


# --------------------------------------------------------------------- bench serve


def test_bench_serve_summary_and_saved_json(server: str, tmp_path: Path) -> None:
    port = server.rsplit(":", 1)[1]
    result = run_cli(
        "bench", "serve", "--port", port, "--num-prompts", "8", "--max-concurrency", "4",
        "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path / "results"),
        "--result-filename", "bench.json", "--metric-percentiles", "50,99",
        env=user_env(OPENAI_API_KEY=API_KEY),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in (
        "Successful requests:                     8",
        "Maximum request concurrency:             4",
        "Total input tokens:                      128",
        "Total generated tokens:                  64",
    ):
        assert line in out, out
    for label in (
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P50 TPOT (ms):",
        "Mean ITL (ms):",
        "P99 ITL (ms):",
    ):
        assert label in out, label
    assert "E2EL" not in out  # not in the default --percentile-metrics
    saved = json.loads((tmp_path / "results" / "bench.json").read_text())
    assert saved["completed"] == 8 and saved["num_prompts"] == 8
    assert saved["max_concurrency"] == 4 and saved["request_rate"] == "inf"
    assert saved["total_input_tokens"] == 128 and saved["total_output_tokens"] == 64
    assert saved["output_lens"] == [8] * 8 and saved["errors"] == [""] * 8
    assert len(saved["ttfts"]) == 8 and all(t > 0 for t in saved["ttfts"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p50_ttft_ms", "duration"):
        assert saved[key] >= 0, key
    assert saved["request_throughput"] > 0 and saved["backend"] == "vllm"


def test_bench_serve_chat_endpoint_with_poisson_arrivals(server: str) -> None:
    result = run_cli(
        "bench", "serve", "--base-url", server, "--endpoint", "/v1/chat/completions",
        "--num-prompts", "4", "--request-rate", "50", "--random-input-len", "12",
        "--random-output-len", "4", "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,e2el",
        env=user_env(OPENAI_API_KEY=API_KEY),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Successful requests:                     4" in result.stdout
    assert "Total generated tokens:                  16" in result.stdout
    assert "Request rate configured (RPS):           50.00" in result.stdout
    assert "Mean E2EL (ms):" in result.stdout and "TPOT" not in result.stdout


def _finished_requests(server: str) -> float:
    text = httpx.get(server + "/metrics", timeout=10).text
    name = "pagedllm:request_success_total"
    lines = [line for line in text.splitlines() if line.startswith(name)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_bench_serve_prefix_repetition_and_warmups(server: str) -> None:
    """vLLM's prefix-repetition dataset (2 prefixes x 2 prompts of 8 + 4 tokens) and
    --num-warmups: the server finishes the test request, 3 warm-up requests, then the 4
    measured ones."""
    before = _finished_requests(server)
    result = run_cli(
        "bench", "serve", "--base-url", server, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--num-prompts", "4", "--num-warmups", "3", "--ignore-eos", "--disable-tqdm",
        env=user_env(OPENAI_API_KEY=API_KEY),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Warming up with 3 requests..." in result.stdout
    assert "Total input tokens:                      48" in result.stdout
    assert "Total generated tokens:                  12" in result.stdout
    assert _finished_requests(server) - before == 1 + 3 + 4
    refused = run_cli(
        "bench", "serve", "--base-url", server, "--random-input-len", "8",
        "--dataset-path", "x.json", env=user_env(OPENAI_API_KEY=API_KEY),
    )  # fmt: skip
    assert refused.returncode == 1
    assert "--random-input-len applies to --dataset-name random, not sharegpt" in refused.stderr


def test_bench_serve_connection_error(server: str) -> None:
    result = run_cli("bench", "serve", "--port", str(free_port()), env=user_env())
    assert result.returncode == 1
    assert "cannot connect" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------ run-batch


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch_good_and_bad_lines(checkpoint: Path, tmp_path: Path) -> None:
    chat = "/v1/chat/completions"
    fixed = {"max_tokens": 5, "min_tokens": 5, "ignore_eos": True}
    lines = [
        _line("chat-1", chat, {"messages": [{"role": "user", "content": "hello"}], **fixed}),
        _line("cmpl-1", "/v1/completions", {"prompt": "Once upon a time", **fixed}),
        "{not json",
        _line("bad-url", "/v1/embeddings", {"input": "x"}),
        # An unknown field is ignored (and named in the log), a known one's bad value not.
        _line("ignored-field", "/v1/completions", {"prompt": "x", "bogus": 1, **fixed}),
        _line("bad-field", "/v1/completions", {"prompt": "x", "bogus": 1, "max_tokens": -1}),
        "",  # blank lines are skipped
        _line("too-long", "/v1/completions", {"prompt": "word " * 400, "max_tokens": 4}),
        _line("cmpl-ids", "/v1/completions", {"prompt": [11, 12, 13], **fixed}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out" / "results.jsonl"
    output.parent.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    result = run_cli(
        "run-batch", "-i", str(source), "-o", str(output), "--model", str(checkpoint),
        *ENGINE_ARGS, "--output-tmp-dir", str(staging), "--response-role", "bot",
        "--enable-prompt-tokens-details", "--enable-log-requests", "--max-log-len", "10",
        env=user_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # --enable-log-requests: accepted requests, capped by --max-log-len; refused ones never
    assert "prompt: 'Once upon '" in result.stderr
    assert "Once upon a" not in result.stderr
    assert "word word" not in result.stderr
    assert "Running batch" in result.stderr  # the progress bar
    assert list(staging.iterdir()) == []  # moved into place
    assert "bogus" in result.stderr  # the ignored field, named
    records = [json.loads(line) for line in output.read_text().splitlines()]
    expected = [
        ("chat-1", 200),
        ("cmpl-1", 200),
        (None, 400),
        ("bad-url", 400),
        ("ignored-field", 200),
        ("bad-field", 400),
        ("too-long", 400),
        ("cmpl-ids", 200),
    ]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in records] == expected
    for record in records:
        assert record["id"].startswith("batch_req_")
        assert record["response"]["request_id"]
        body = record["response"]["body"]
        if record["response"]["status_code"] == 200:
            assert record["error"] is None
            assert body["usage"]["completion_tokens"] == 5
            assert "prompt_tokens_details" in body["usage"]
        else:
            assert record["error"]["message"] == body["error"]["message"]
            assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"
    chat_body = records[0]["response"]["body"]
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["role"] == "bot"
    assert chat_body["choices"][0]["message"]["content"]
    assert records[1]["response"]["body"]["choices"][0]["text"]
    assert records[7]["response"]["body"]["usage"]["prompt_tokens"] == 3
    messages = [r["response"]["body"]["error"]["message"] for r in records[2:4] + records[5:7]]
    assert "invalid JSON" in messages[0]
    assert "/v1/embeddings" in messages[1]
    assert "max_tokens" in messages[2]
    assert "maximum context length" in messages[3]


def test_run_batch_refuses_urls_and_missing_files(tmp_path: Path) -> None:
    result = run_cli("run-batch", "-i", "https://example.com/in.jsonl", "-o", "out.jsonl")
    assert result.returncode == 2 and "URLs are not supported" in result.stderr
    result = run_cli("run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", "out.jsonl")
    assert result.returncode == 2 and "cannot read it" in result.stderr
    missing = run_cli("run-batch")
    assert missing.returncode == 2 and "-i/--input-file is required" in missing.stderr
