"""The model's generation config in the OpenAI server and ``run-batch``: its sampling
values are the defaults of requests that do not set them (a request's own values, 1.0 or
0 included, go first), and its ``max_new_tokens`` caps every request's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import clean_env, run_cli
from openai_server import BASE_ARGS, RemoteServer, start_servers, tiny_llama

MODEL = "tiny"
USER = [{"role": "user", "content": "Hello, how are you?"}]
CAP = 3


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generation config: greedy by default, at most 5 new tokens (the server's
    --override-generation-config lowers that to CAP)."""
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5})
    )
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, generation_dir: Path):
    remote = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        MODEL,
        "--generation-config",
        str(generation_dir),
        "--override-generation-config",
        json.dumps({"max_new_tokens": CAP}),
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer):
    with server.client() as c:
        yield c


def test_start_up_log_names_the_defaults(server: RemoteServer) -> None:
    lines = [line for line in server.log_text().splitlines() if "sampling defaults" in line]
    assert len(lines) == 1, lines
    assert "temperature=0.0" in lines[0] and f"at most {CAP}" in lines[0], lines[0]
    assert "--override-generation-config" in lines[0] and "generation_config.json" in lines[0]


def test_max_new_tokens_caps_completions_and_chat(client) -> None:
    common = dict(model=MODEL, prompt="Hello world", extra_body={"ignore_eos": True})
    for asked in ({}, {"max_tokens": 10}):
        response = client.completions.create(**common, **asked)
        assert response.usage.completion_tokens == CAP, asked
        assert response.choices[0].finish_reason == "length" and response.choices[0].text
    stream = dict(stream=True, stream_options={"include_usage": True})
    chunks = list(client.completions.create(**common, max_tokens=16, **stream))
    assert chunks[-1].usage.completion_tokens == CAP
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    smaller = client.completions.create(**common, max_tokens=2)
    assert smaller.usage.completion_tokens == 2
    chat = dict(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    for asked in ({}, {"max_tokens": 10}, {"max_completion_tokens": 12}):
        reply = client.chat.completions.create(**chat, **asked)
        assert reply.usage.completion_tokens == CAP, asked
        assert reply.choices[0].finish_reason == "length"
    beams = client.completions.create(
        model=MODEL,
        prompt="Hello world",
        max_tokens=10,
        n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert beams.usage.completion_tokens == 2 * CAP


def test_unset_fields_take_the_model_defaults_set_ones_win(client) -> None:
    common = dict(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    greedy = client.completions.create(**common, temperature=0).choices[0].text
    # No temperature: the generation config's 0, whatever the seed.
    for seed in (1, 2, 3):
        assert client.completions.create(**common, seed=seed).choices[0].text == greedy
    # An explicit temperature of 1.0 (OpenAI's own default) is the request's, not the
    # model's: it samples.
    sampled = {
        client.completions.create(**common, temperature=1.0, seed=seed).choices[0].text
        for seed in (1, 2, 3, 4, 5)
    }
    assert sampled - {greedy}
    chat = dict(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    chat_greedy = client.chat.completions.create(**chat, temperature=0)
    unset = client.chat.completions.create(**chat, seed=7)
    assert unset.choices[0].message.content == chat_greedy.choices[0].message.content


def test_run_batch_is_capped(
    tmp_path_factory: pytest.TempPathFactory, generation_dir: Path, tmp_path: Path
) -> None:
    body = {"ignore_eos": True}
    lines = [
        {"url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 10, **body}},
        {"url": "/v1/chat/completions", "body": {"messages": USER, **body}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(
            json.dumps({"custom_id": str(i), "method": "POST", **line}) + "\n"
            for i, line in enumerate(lines)
        )
    )
    output = tmp_path / "out.jsonl"
    result = run_cli(
        "run-batch", "-i", str(source), "-o", str(output),
        "--model", str(tiny_llama(tmp_path_factory)), *BASE_ARGS,
        "--generation-config", str(generation_dir),
        env=clean_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in records] == [200, 200]
    # The folder's own max_new_tokens (5): no override here.
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in records] == [5, 5]
